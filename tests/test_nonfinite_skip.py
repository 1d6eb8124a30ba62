"""OptimizerConfig(skip_nonfinite=True): a non-finite gradient skips the update and says so; off, NaN spreads.

See [Note: non-finite updates] in runtime/optim/cpu_adamw.py.
"""
from __future__ import annotations

import pytest
import torch

from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan

CONFIG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2)
IDS = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
MODES = [("deferred", 1.0), ("deferred", None), ("eager", None)]


def _bits(state: dict) -> dict:
    """Tensors as their bit patterns: NaN compares equal to itself."""
    out = {}
    for name, value in state.items():
        if isinstance(value, dict):
            out.update({f"{name}.{k}": v.view(torch.int32).clone() for k, v in value.items()})
        else:
            out[name] = value.view(torch.int32).clone()
    return out


def _poisoned(engine: Engine) -> dict:
    """The engine's weights with one lm_head row set to NaN: every logit, the loss and every gradient go NaN."""
    state = engine.state_dict()
    state["lm_head.weight"] = state["lm_head.weight"].clone()
    state["lm_head.weight"][5] = float("nan")
    return state


@pytest.mark.parametrize("resident", [(), (0, 2), (0, 1, 2, 3)], ids=["host", "some-resident", "all-resident"])
@pytest.mark.parametrize("mode, clip", MODES)
def test_nonfinite_gradient_skips_the_update(mode, clip, resident) -> None:
    """In host RAM, and with some or every block's state on the device ([Note: non-finite updates on the device])."""
    opt = OptimizerConfig(lr=1e-2, max_grad_norm=clip, skip_nonfinite=True)
    plan = Plan(optimizer_mode=mode, resident_blocks=resident)
    with Engine(CONFIG, opt, plan=plan, compute_dtype=torch.float32, device="cpu") as engine:
        engine.step(IDS, IDS)
        good = engine.state_dict()
        engine.load_state_dict(_poisoned(engine))
        before = (_bits(engine.state_dict()), _bits(engine.optimizer_state_dict()))
        loss = engine.step(IDS, IDS)
        assert not torch.isfinite(loss)
        with pytest.warns(RuntimeWarning, match=r"step 2: the gradient is not finite.*skipped"):
            engine.synchronize()
        assert engine.skipped_steps == [2]
        after = (_bits(engine.state_dict()), _bits(engine.optimizer_state_dict()))
        for a, b in zip(after, before):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "a skipped update changed state"
        engine.load_state_dict(good)  # the cause is gone: training goes on
        engine.step(IDS, IDS)
        engine.synchronize()
        state = engine.optimizer_state_dict()
        assert all(bool(torch.isfinite(t).all()) for t in engine.state_dict().values())
        assert all(float(s["step"]) == 2.0 for s in state.values())  # step 2 did not count


@pytest.mark.parametrize("mode, clip", MODES)
def test_without_the_flag_nan_reaches_the_masters(mode, clip) -> None:
    opt = OptimizerConfig(lr=1e-2, max_grad_norm=clip)
    with Engine(CONFIG, opt, plan=Plan(optimizer_mode=mode), compute_dtype=torch.float32, device="cpu") as engine:
        engine.load_state_dict(_poisoned(engine))
        engine.step(IDS, IDS)
        engine.synchronize()
        assert engine.skipped_steps == []
        assert not bool(torch.isfinite(engine.state_dict()["model.embed_tokens.weight"]).all())
