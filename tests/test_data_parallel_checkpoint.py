"""Checkpoints and export of data-parallel runs: a checkpoint saved by 2 ranks (each writing its shards into the
same arrays, rank 0 committing) loads at world size 1, 2 and 3 with the state bitwise as saved; resumed at the
same world size it continues bitwise as the uninterrupted run; save_pretrained writes what one process loads."""
from __future__ import annotations

import json
import os

import torch

from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan
from numerics import assert_update_close
from rank_processes import run_ranks

BATCH, SEQ = 6, 12


def _config() -> ModelConfig:
    return ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)


def _batches(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 61, (BATCH, SEQ), generator=gen) for _ in range(n)]
    return [(i, i.clone()) for i in ids]


def _state(engine: Engine) -> dict:
    """Weights and AdamW state, gathered (a collective in data parallel)."""
    opt = engine.optimizer_state_dict()
    return {"weights": engine.state_dict(),
            "exp_avg": {k: v["exp_avg"] for k, v in opt.items()},
            "exp_avg_sq": {k: v["exp_avg_sq"] for k, v in opt.items()},
            "steps": {k: float(v["step"]) for k, v in opt.items()}}


def _continue(engine: Engine, rank: int, world: int) -> dict:
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    losses = [engine.step(ids[rows], labels[rows]).item() for ids, labels in _batches(2, seed=11)]
    return {"losses": losses, "weights": engine.state_dict()}


def _save_then_resume(rank: int, world: int, ckpt: str, export: str) -> dict:
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    optimizer = OptimizerConfig(lr=1e-3, max_grad_norm=1.0, no_decay=("norm",))
    with Engine(_config(), optimizer, plan=Plan(micro_batch_size=1), compute_dtype=torch.float32,
                device="cpu", seed=5) as engine:
        for ids, labels in _batches(2, seed=10):
            engine.step(ids[rows], labels[rows])
        path = engine.save_checkpoint(ckpt, extra={"position": 2}).wait()
        saved = _state(engine)
        uninterrupted = _continue(engine, rank, world)
        engine.save_pretrained(export, dtype=torch.float32)
    with Engine.load_checkpoint(ckpt, device="cpu") as engine:
        loaded = _state(engine)
        resumed = _continue(engine, rank, world)
        extra = engine.checkpoint_extra
    return {"path": path, "saved": saved, "uninterrupted": uninterrupted, "loaded": loaded, "resumed": resumed,
            "extra": extra}


def _resume(rank: int, world: int, ckpt: str) -> dict:
    with Engine.load_checkpoint(ckpt, device="cpu") as engine:
        return {"loaded": _state(engine), "resumed": _continue(engine, rank, world)}


def _assert_same_state(a: dict, b: dict) -> None:
    for part in ("weights", "exp_avg", "exp_avg_sq"):
        assert a[part].keys() == b[part].keys()
        for name in a[part]:
            assert torch.equal(a[part][name], b[part][name]), (part, name)
    assert a["steps"] == b["steps"]


def test_checkpoint_saved_by_two_ranks_loads_at_any_world_size(tmp_path):
    ckpt, export = str(tmp_path / "ckpt"), str(tmp_path / "export")
    two = run_ranks(_save_then_resume, 2, tmp_path, ckpt, export)
    first = two[0]
    assert [r["path"] for r in two] == [first["path"]] * 2
    assert os.path.basename(first["path"]) == "step-00000002"
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read().strip() == "step-00000002"
    assert not [n for n in os.listdir(ckpt) if n.endswith(".tmp")]
    for r in two:
        assert r["extra"] == {"position": 2}
        _assert_same_state(r["loaded"], first["saved"])  # what was saved, bitwise, on every rank
        assert r["resumed"]["losses"] == r["uninterrupted"]["losses"]  # the same world size continues bitwise
        for name, t in r["uninterrupted"]["weights"].items():
            assert torch.equal(r["resumed"]["weights"][name], t), name

    # One process: the same state bitwise (its reader verifies the CRC32s the ranks' pieces were combined into).
    with Engine.load_checkpoint(ckpt, device="cpu") as engine:
        _assert_same_state(_state(engine), first["saved"])
        single = _continue(engine, 0, 1)
    for a, b in zip(first["uninterrupted"]["losses"], single["losses"]):
        assert abs(a - b) <= 1e-6 * abs(b)

    three = run_ranks(_resume, 3, tmp_path, ckpt)
    for r in three:
        _assert_same_state(r["loaded"], first["saved"])
        for a, b in zip(r["resumed"]["losses"], single["losses"]):
            assert abs(a - b) <= 1e-6 * abs(b)
        assert_update_close(r["resumed"]["weights"], single["weights"], first["saved"]["weights"], what="world 3")

    # The export, written by rank 0 from blocks gathered one at a time, is the final model.
    with open(os.path.join(export, "config.json")) as f:
        assert json.load(f)["hidden_size"] == 32
    with Engine.from_pretrained(export, compute_dtype=torch.float32, device="cpu") as engine:
        exported = engine.state_dict()
    for name, t in first["uninterrupted"]["weights"].items():
        assert torch.equal(exported[name], t), name
