"""Spill placement per block and kind: each (block, kind) in RAM or in its spill file, training unchanged.

Partial placements (``Plan(spill="blocks", spill_blocks=...)``) train bitwise like plain PyTorch (the
reference of tests/test_equivalence.py), keep exactly the named blocks on disk and the rest in RAM (the
planner's memory model says the same bytes), and checkpoints move between placements.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatrain.planner.costs import memory_model
from megatrain.planner.shapes import model_shapes
from megatrain.plan.buffer_kinds import BufferKind, spill_block_bytes
from megatrain.plan.plan import SpillBlocks
from megatrain.planner.shapes.workload import Workload
from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan, PlanError
from test_equivalence import run_case

CONFIG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2)
# Blocks: 0 embedding, 1..3 layers, 4 head.
PLACEMENTS = [
    SpillBlocks(exp_avg=(3, 4), exp_avg_sq=(3, 4)),  # the planner's first levels: m and v of the last blocks
    SpillBlocks(master=(0, 2), exp_avg=(1,), exp_avg_sq=(4,), grads=(2, 3)),  # kinds split across blocks
    SpillBlocks(master=(4,), exp_avg=(0, 1, 2, 3, 4), exp_avg_sq=(0, 1, 2, 3, 4), grads=(0,)),
    SpillBlocks(grads=(1,)),  # only gradients (eager mode: nothing spills)
]


def _plan(blocks: SpillBlocks, spill_dir: str, **kw) -> Plan:
    # 4 KiB chunks: the embedding, the head and every layer are read, updated and written in pieces.
    return Plan(spill="blocks", spill_blocks=blocks, spill_dir=spill_dir, spill_chunk_bytes=4096, spill_staging=2,
                io_backend="posix", **kw)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("placement", range(len(PLACEMENTS)))
@pytest.mark.parametrize("mode", ["deferred", "eager"])
def test_partial_placements_train_bitwise_like_pytorch(tmp_path, placement, tied, mode):
    config = ModelConfig(**{**CONFIG.to_dict(), "tie_word_embeddings": tied})
    clip = 1.0 if mode == "deferred" else None
    plan = _plan(PLACEMENTS[placement], str(tmp_path), optimizer_mode=mode, micro_batch_size=2,
                 checkpoints="host" if placement % 2 else "device")
    # batch 2 in one micro-batch, one loss chunk, untiled: no source of a summation-order difference.
    run_case(config, plan, OptimizerConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=clip, no_decay=("norm",)),
             batch=2, seq=7, lrs=[1e-3, 3e-4, 1e-3], seed=placement)
    assert os.listdir(tmp_path) == [], "spill files left behind after close"


def test_only_the_named_blocks_live_on_disk_and_the_planner_agrees(tmp_path):
    blocks = PLACEMENTS[1]
    plan = _plan(blocks, str(tmp_path))
    with Engine(CONFIG, OptimizerConfig(max_grad_norm=1.0), plan=plan, device="cpu",
                compute_dtype=torch.bfloat16) as engine:
        store, numels = engine.store, engine.store.numels
        files = store.disk
        assert files is not None
        for kind in BufferKind:
            spilled = set(blocks.blocks(kind.value))
            assert {b for b in range(len(numels)) if store.is_spilled(kind, b)} == spilled, kind
            assert files.file_bytes.get(kind, 0) == sum(spill_block_bytes(numels[b]) for b in spilled), kind
            arena = store.ram_arena(kind)
            assert (arena.tensor.numel() if arena else 0) == sum(n for b, n in enumerate(numels) if b not in spilled)
            assert store.arena(kind) is None  # partly spilled: read block by block
        assert os.path.getsize(os.path.join(files.root, "master.bin")) == files.file_bytes[BufferKind.MASTER]
        # the planner's memory model: the same RAM arenas and files
        shape = model_shapes.from_config({"model_type": "llama", **CONFIG.to_dict()})
        est = {c.name: c.nbytes for c in memory_model.estimate(shape, Workload(7, 2, "bf16"), plan).components}
        assert est["fp32 master"] == store.master.nbytes and est["Adam m"] == store.exp_avg.nbytes
        assert est["Adam v"] == store.exp_avg_sq.nbytes and est["fp32 grads (full arena)"] == store.grads.nbytes
        on_disk = sum(v for k, v in est.items() if k.endswith("(spill file)"))
        assert on_disk == store.nvme_bytes
        assert est["spill staging"] == files.staging.nbytes
        assert est["fp32 grad slabs"] == store.slabs.arena.nbytes


def test_checkpoint_moves_between_placements(tmp_path):
    """Save under one partial placement, resume under another (and with nothing spilled): the same training."""
    opt = OptimizerConfig(lr=1e-3, max_grad_norm=1.0)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, CONFIG.vocab_size, (2, 7), generator=gen) for _ in range(4)]
    spill = str(tmp_path / "spill")
    os.makedirs(spill)
    with Engine(CONFIG, opt, plan=Plan(), device="cpu", compute_dtype=torch.float32) as straight:
        for ids in batches:
            straight.step(ids, ids)
        expected = straight.state_dict(), straight.optimizer_state_dict()
    with Engine(CONFIG, opt, plan=_plan(PLACEMENTS[1], spill), device="cpu", compute_dtype=torch.float32) as first:
        for ids in batches[:2]:
            first.step(ids, ids)
        first.save_checkpoint(str(tmp_path / "ckpt"), blocking=True)
    for plan in (_plan(PLACEMENTS[2], spill), Plan()):
        with Engine.load_checkpoint(str(tmp_path / "ckpt"), device="cpu", plan=plan) as resumed:
            for ids in batches[2:]:
                resumed.step(ids, ids)
            params, state = resumed.state_dict(), resumed.optimizer_state_dict()
        assert all(torch.equal(params[k], expected[0][k]) for k in expected[0]), plan.spill
        for k, s in expected[1].items():
            assert all(torch.equal(state[k][f], s[f]) for f in ("exp_avg", "exp_avg_sq", "step")), (plan.spill, k)


def test_placement_errors_are_one_line(tmp_path):
    d = str(tmp_path)
    bad = [
        lambda: Plan(spill="blocks", spill_dir=d),
        lambda: Plan(spill="blocks", spill_blocks=SpillBlocks(), spill_dir=d),
        lambda: Plan(spill="optimizer", spill_blocks=SpillBlocks(master=(0,)), spill_dir=d),
        lambda: Plan(spill="blocks", spill_blocks=SpillBlocks(master=(0,))),
        lambda: SpillBlocks(master=(1, 1)),
        lambda: SpillBlocks(exp_avg=(-1,)),
        lambda: SpillBlocks(grads=(True,)),
        lambda: Plan.from_dict({**json.loads(Plan().to_json()), "spill": "blocks", "spill_dir": d,
                                "spill_blocks": {"shadow": [0]}}),
        lambda: Engine(CONFIG, plan=Plan(spill="blocks", spill_blocks=SpillBlocks(master=(5,)), spill_dir=d),
                       device="cpu"),
    ]
    for make in bad:
        with pytest.raises(PlanError) as e:
            make()
        assert "\n" not in str(e.value) and len(str(e.value)) < 300, str(e.value)
    assert os.listdir(d) == []


def test_placement_round_trips_through_json_and_shorthands_expand():
    plan = Plan(spill="blocks", spill_blocks={"master": [2, 0], "grads": [1]}, spill_dir="/x")
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.spill_blocks == SpillBlocks(master=(0, 2), grads=(1,))
    assert json.loads(plan.to_json())["spill_blocks"]["master"] == [0, 2]
    every = (0, 1, 2)
    assert Plan(spill="optimizer", spill_dir="/x").spill_placement(3) == {
        "master": (), "exp_avg": every, "exp_avg_sq": every, "grads": ()}
    assert Plan(spill="all", spill_dir="/x").spill_placement(3) == {k: every for k in
                                                                   ("master", "exp_avg", "exp_avg_sq", "grads")}
    assert Plan().spill_placement(3) == {k: () for k in ("master", "exp_avg", "exp_avg_sq", "grads")}
