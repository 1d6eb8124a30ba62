"""Training checkpoints: bitwise resume in a new process, asynchronous saves, retention, corrupt files.

Resume: 2N steps straight equal N steps, a checkpoint, a fresh Python process
that loads it and trains N more, bitwise (fp32 masters, AdamW m and v, steps).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatrain.runtime import ConfigError, Engine, InputError, ModelConfig, OptimizerConfig, Plan

CONFIG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
OPT = OptimizerConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=0.5, no_decay=("norm",))
PLAN = Plan(micro_batch_size=2, loss_chunk_tokens=16)
N = 3


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, CONFIG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(100 + step))
    return ids, ids.clone()


def engine(plan: Plan = PLAN, optimizer: OptimizerConfig = OPT) -> Engine:
    return Engine(CONFIG, optimizer, plan=plan, compute_dtype=torch.float32, device="cpu", seed=5)


def train(e: Engine, start: int, stop: int) -> None:
    for step in range(start, stop):
        e.step(*batch(step), lr=1e-2 / (1 + step))  # a schedule: the caller's lr per step


def state(e: Engine) -> dict[str, torch.Tensor]:
    e.synchronize()
    s = e.store
    return {"master": s.master.tensor.clone(), "exp_avg": s.exp_avg.tensor.clone(),
            "exp_avg_sq": s.exp_avg_sq.tensor.clone(), "steps": torch.stack(s.steps)}


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name in a:
        assert torch.equal(a[name], b[name]), name


RESUME_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[3])
    from test_checkpoint import N, train
    from megatrain.runtime import Engine

    engine = Engine.load_checkpoint(sys.argv[1], device="cpu")
    assert engine.step_count == N, engine.step_count
    position = engine.checkpoint_extra["data_position"]
    train(engine, position, position + N)
    engine.save_checkpoint(sys.argv[2], extra={"data_position": position + N}, blocking=True)
    engine.close()
""")


def test_resume_in_a_new_process_is_bitwise(tmp_path) -> None:
    with engine() as straight:
        train(straight, 0, 2 * N)
        expected = state(straight)
    with engine() as first:
        train(first, 0, N)
        first.save_checkpoint(tmp_path / "a", extra={"data_position": N}).wait()
    out = subprocess.run([sys.executable, "-c", RESUME_SCRIPT, str(tmp_path / "a"), str(tmp_path / "b"),
                          os.path.dirname(__file__)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    with Engine.load_checkpoint(tmp_path / "b") as resumed:
        assert resumed.step_count == 2 * N and resumed.checkpoint_extra == {"data_position": 2 * N}
        assert resumed.compute_dtype == torch.float32 and resumed.optimizer == OPT and resumed.plan == PLAN
        assert_bitwise(state(resumed), expected)


def test_resume_in_process_eager_plan_and_a_new_plan(tmp_path) -> None:
    eager, opt = PLAN.replace(optimizer_mode="eager"), OptimizerConfig(lr=1e-2, max_grad_norm=None)
    with engine(eager, opt) as straight:
        train(straight, 0, 4)
        expected = state(straight)
    with engine(eager, opt) as first:
        train(first, 0, 2)
        first.save_checkpoint(tmp_path, blocking=True)
    # Another machine may bring another plan (same micro-batches: their sum order is part of the numbers).
    other = eager.replace(num_slots=3, prefetch_depth=2, checkpoints="host")
    with Engine.load_checkpoint(tmp_path, plan=other) as resumed:
        assert resumed.plan == other
        train(resumed, 2, 4)
        assert_bitwise(state(resumed), expected)


def test_async_save_is_a_snapshot_while_training_continues(tmp_path) -> None:
    with engine() as e:
        train(e, 0, 2)
        handle = e.save_checkpoint(tmp_path, extra={"at": 2})
        saved = state(e)
        train(e, 2, 4)  # runs while the checkpoint is written
        assert handle.wait() == str(tmp_path / "step-00000002") == e.wait_for_checkpoint()
        assert handle.stall_s < handle.write_s + 1.0
        after = state(e)
    with Engine.load_checkpoint(tmp_path) as loaded:
        assert loaded.step_count == 2 and loaded.checkpoint_extra == {"at": 2}
        assert_bitwise(state(loaded), saved)
    assert not torch.equal(after["master"], saved["master"])


def test_keep_latest_and_half_written_directories(tmp_path) -> None:
    with engine() as e:
        for step in range(4):
            train(e, step, step + 1)
            e.save_checkpoint(tmp_path, keep=2)
        e.wait_for_checkpoint()
        assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000003", "step-00000004"]
        assert (tmp_path / "latest").read_text().strip() == "step-00000004"
        # A crashed writer's leftovers: a .tmp directory and a step directory without a manifest.
        (tmp_path / "step-00000009.tmp").mkdir()
        (tmp_path / "step-00000007").mkdir()
        with Engine.load_checkpoint(tmp_path) as loaded:
            assert loaded.step_count == 4
        (tmp_path / "latest").write_text("step-00000007\n")  # points at the incomplete one: the newest complete
        with Engine.load_checkpoint(tmp_path) as loaded:
            assert loaded.step_count == 4
        with Engine.load_checkpoint(tmp_path / "step-00000003") as loaded:
            assert loaded.step_count == 3
        e.save_checkpoint(tmp_path, keep=1, blocking=True)  # re-saving step 4 replaces it
        assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000004", "step-00000007"]


def _one_line(err: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.fixture()
def saved(tmp_path):
    with engine() as e:
        train(e, 0, 1)
        e.save_checkpoint(tmp_path, blocking=True)
    return tmp_path / "step-00000001"


def test_flipped_byte_is_a_checksum_error(saved) -> None:
    data = saved / "exp_avg" / "c" / "0"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(InputError, match="checksum mismatch") as err:
        Engine.load_checkpoint(saved.parent)
    assert "exp_avg" in _one_line(err)


def test_truncated_or_missing_files_are_errors(saved) -> None:
    data = saved / "master" / "c" / "0"
    raw = data.read_bytes()
    data.write_bytes(raw[:-10])
    with pytest.raises(InputError, match="truncated") as err:
        Engine.load_checkpoint(saved.parent)
    assert "master" in _one_line(err)
    data.unlink()
    with pytest.raises(InputError, match="missing"):
        Engine.load_checkpoint(saved)


def test_corrupt_manifest_and_empty_directory(saved, tmp_path) -> None:
    manifest = saved / "manifest.json"
    text = manifest.read_text()
    manifest.write_text(text[: len(text) // 2])
    with pytest.raises(InputError, match="corrupt or truncated") as err:
        Engine.load_checkpoint(saved.parent)
    _one_line(err)
    manifest.write_text(json.dumps({**json.loads(text), "version": 99}))
    with pytest.raises(InputError, match="version 99"):
        Engine.load_checkpoint(saved)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no complete checkpoint"):
        Engine.load_checkpoint(tmp_path / "empty")


def test_bad_arguments(tmp_path) -> None:
    with engine() as e:
        with pytest.raises(InputError, match="extra is not JSON-serialisable"):
            e.save_checkpoint(tmp_path, extra={"rng": torch.zeros(2)})
        with pytest.raises(ConfigError, match="keep=0"):
            e.save_checkpoint(tmp_path, keep=0)
        assert e.wait_for_checkpoint() is None
    assert os.listdir(tmp_path) == []
