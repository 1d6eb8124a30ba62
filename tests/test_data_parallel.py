"""Data parallelism on CPU ranks (gloo): W ranks train the same model as one process on the same global batch.

Each rank takes its rows of the global batch (rank r: rows [r*B/W, (r+1)*B/W)), in the same
micro-batches as the single process. The loss is the same sum over the same micro-batches divided
by the same global token count, so losses agree within 1e-6 relative; the gradients differ only in
summation order (each rank sums its micro-batches, then the reduce-scatter sums the ranks; the
global norm sums per-rank partial squares), so parameters are held to the update-relative noise
bound (numerics.assert_update_close), with and without clipping, with and without spill.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatrain.plan.plan import SpillBlocks
from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan
from numerics import assert_update_close
from rank_processes import run_ranks

BATCH, SEQ, STEPS = 6, 12, 3


def _config(tied: bool) -> ModelConfig:
    return ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)


def _batches(config: ModelConfig):
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)
        labels = ids.clone()
        labels[torch.rand(BATCH, SEQ, generator=gen) < 0.2] = -100
        labels[:, 1] = ids[:, 0]  # every row predicts something
        out.append((ids, labels))
    return out


def _train(rank: int, world: int, tied: bool, clip: float | None, plan: Plan) -> dict:
    """One rank's (or, world 1, the single process's) run: losses, norms and the final weights."""
    config = _config(tied)
    if plan.spill != "none":  # each rank's spill files in a directory of its own under the one given
        plan = dataclasses.replace(plan, spill_dir=os.path.join(plan.spill_dir, f"rank{rank}-of-{world}"))
        os.makedirs(plan.spill_dir, exist_ok=True)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    optimizer = OptimizerConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=clip, no_decay=("norm",))
    with Engine(config, optimizer, plan=plan, compute_dtype=torch.float32, device="cpu", seed=3) as engine:
        initial = engine.state_dict()
        losses, norms = [], []
        for ids, labels in _batches(config):
            losses.append(engine.step(ids[rows], labels[rows]).item())
            norms.append(engine.grad_norm.item())
        final = engine.state_dict()  # a collective: every rank gathers
    return {"losses": losses, "norms": norms, "initial": initial, "final": final}


def _ranks_train(rank: int, world: int, cases: list) -> list:
    return [_train(rank, world, *case) for case in cases]


def _cases(spill_dir: str) -> list:
    """(tied, clip, plan): deferred with and without clipping, eager; a tied head; everything spilled; some
    blocks' kinds spilled, in 4 KiB chunks."""
    return [
        (False, 1.0, Plan(micro_batch_size=1, num_slots=3, prefetch_depth=2)),
        (False, None, Plan(micro_batch_size=1, optimizer_mode="eager", host_grad_slabs=1)),
        (True, 0.05, Plan(micro_batch_size=1, checkpoints="host")),
        (False, 1.0, Plan(micro_batch_size=1, spill="all", spill_dir=spill_dir, spill_staging=2)),
        (True, 1.0, Plan(micro_batch_size=1, spill="blocks", spill_dir=spill_dir, spill_chunk_bytes=4096,
                         spill_blocks=SpillBlocks(master=(0, 2), exp_avg=(1, 3), exp_avg_sq=(3,), grads=(2,)))),
    ]


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory) -> list[dict]:
    """The one-process run of each case, which every world size is held to (where it spills does not change it)."""
    return [_train(0, 1, *case) for case in _cases(str(tmp_path_factory.mktemp("spill")))]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_train_as_one_process(world, tmp_path, single_runs):
    cases = _cases(str(tmp_path / "spill"))
    results = run_ranks(_ranks_train, world, tmp_path, cases)
    for i, (case, single) in enumerate(zip(cases, single_runs)):
        for rank in range(world):
            got = results[rank][i]
            assert got["initial"].keys() == single["initial"].keys()
            for name, t in single["initial"].items():  # the same model on every rank before training
                assert torch.equal(got["initial"][name], t), name
            for a, b in zip(got["losses"], single["losses"]):
                assert abs(a - b) <= 1e-6 * abs(b), (case, rank, got["losses"], single["losses"])
            for a, b in zip(got["norms"], single["norms"]):
                assert abs(a - b) <= 1e-5 * abs(b), (case, rank, got["norms"], single["norms"])
            assert_update_close(got["final"], single["final"], single["initial"], what=f"world {world} case {i}")
        for rank in range(1, world):  # every rank holds the same model
            for name, t in results[0][i]["final"].items():
                assert torch.equal(results[rank][i]["final"][name], t), name


def _whole_block_reads(rank: int, world: int, spill_dir: str) -> int:
    """Whole-block (shard-sized) reads of the spill files during two steps of an fp32 run whose masters all spill."""
    spill_dir = os.path.join(spill_dir, f"reads-rank{rank}")
    os.makedirs(spill_dir, exist_ok=True)
    plan = Plan(micro_batch_size=1, spill="all", spill_dir=spill_dir, spill_chunk_bytes=4096)
    with Engine(_config(False), OptimizerConfig(max_grad_norm=1.0), plan=plan, compute_dtype=torch.float32,
                device="cpu", seed=3) as engine:
        files = engine.store.disk
        whole = files.read_block
        calls = []
        files.read_block = lambda kind, b: calls.append((kind, b)) or whole(kind, b)
        rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        for ids, labels in _batches(_config(False))[:2]:
            engine.step(ids[rows], labels[rows])
        engine.synchronize()
    return len(calls)


def test_spilled_master_shards_load_without_a_whole_shard_buffer(tmp_path):
    """A rank's load of a spilled fp32 master reads its shard into the slot (chunk by chunk on CUDA): never a
    whole-shard read into a buffer of its own."""
    assert run_ranks(_whole_block_reads, 2, tmp_path, str(tmp_path / "spill")) == [0, 0]
