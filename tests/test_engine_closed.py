"""A closed Engine refuses every public method at once, with one line: no hang, no silent loss."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from megatrain.runtime import ClosedError, Engine, MegatrainError, ModelConfig, OptimizerConfig, Plan

CONFIG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2)
IDS = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))


def _calls(tmp_path, state):
    return {
        "step": lambda e: e.step(IDS, IDS),
        "logits": lambda e: e.logits(IDS),
        "synchronize": lambda e: e.synchronize(),
        "state_dict": lambda e: e.state_dict(),
        "load_state_dict": lambda e: e.load_state_dict(state),
        "optimizer_state_dict": lambda e: e.optimizer_state_dict(),
        "save_pretrained": lambda e: e.save_pretrained(tmp_path / "hf"),
        "save_checkpoint": lambda e: e.save_checkpoint(tmp_path / "ckpt"),
        "wait_for_checkpoint": lambda e: e.wait_for_checkpoint(),
        "grad_norm": lambda e: e.grad_norm,
        "last_step_breakdown": lambda e: e.last_step_breakdown,
        "time_next_step": lambda e: e.time_next_step(),
        "step_count": lambda e: e.step_count,
    }


def _within(seconds: float, fn):
    """fn()'s exception (or None), failing the test if fn has not returned within ``seconds``."""
    out: list = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the call hung on a closed engine"
    return out[0]


@pytest.mark.parametrize("mode", ["eager", "deferred"])
def test_every_method_of_a_closed_engine_raises_at_once(tmp_path, mode) -> None:
    clip = 1.0 if mode == "deferred" else None
    engine = Engine(CONFIG, OptimizerConfig(max_grad_norm=clip), plan=Plan(optimizer_mode=mode),
                    compute_dtype=torch.float32, device="cpu")
    engine.step(IDS, IDS)
    state = engine.state_dict()
    engine.save_checkpoint(tmp_path / "before").wait()
    engine.close()
    engine.close()  # closing twice is harmless
    for name, call in _calls(tmp_path, state).items():
        err = _within(10.0, lambda: call(engine))
        assert isinstance(err, ClosedError) and isinstance(err, MegatrainError), (name, err)
        assert "\n" not in str(err) and "closed" in str(err), str(err)
    assert not os.path.exists(tmp_path / "hf") and not os.path.exists(tmp_path / "ckpt"), "a closed engine wrote"
    with Engine.load_checkpoint(tmp_path / "before") as resumed:  # what was saved before close() is intact
        assert resumed.step_count == 1


def test_with_block_closes(tmp_path) -> None:
    with Engine(CONFIG, compute_dtype=torch.float32, device="cpu") as engine:
        engine.step(IDS, IDS)
    with pytest.raises(ClosedError):
        engine.step(IDS, IDS)
