"""One data-parallel rank's memory: the planner's per-rank figure against the rank's real buffers, buffer by buffer
([Note: per-rank buffers] in planner/costs/data_parallel.py), and the collectives of a CPU rank allocating nothing the
size of a block ([Note: collectives in place on gloo] in runtime/distributed/collectives.py); the CPU device's
allocator-retention term by hand, and the glibc behaviour it stands on ([Note: allocator retention] in
planner/costs/allocator_retention.py).

Peak RSS against the planner's figure is a benchmark row (benchmarks/scaling.py): the machine is shared."""
from __future__ import annotations

import os
import platform

import pytest
import torch

from rank_processes import run_ranks
from megatrain.planner.costs import data_parallel
from megatrain.planner.shapes import model_shapes
from megatrain.plan.plan import Plan
from megatrain.planner.profiling.profiler import detect
from megatrain.planner.shapes.workload import Workload

# "tied": its embedding (24,064 elements) the largest block; the gradient accumulators a layer's (17,600)
HF = {"tied": dict(model_type="qwen2", vocab_size=501, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
      "untied": dict(model_type="llama", vocab_size=517, hidden_size=40, intermediate_size=64, num_hidden_layers=3,
                     num_attention_heads=5, num_key_value_heads=5, attention_bias=True)}
PLANS = {"default": Plan(micro_batch_size=1, num_slots=2, prefetch_depth=1),
         "host": Plan(micro_batch_size=2, num_slots=3, prefetch_depth=2, device_grad_buffers=3, checkpoints="host"),
         "eager": Plan(micro_batch_size=1, optimizer_mode="eager", host_grad_slabs=2)}
# Optimizer state on the device ([Note: resident blocks]): a rank holds its shard of each resident block there, and
# none of it on the host (deferred: the tied embedding resident; eager: the slab the largest host block's shard).
RESIDENT = {"resident": Plan(micro_batch_size=1, num_slots=2, prefetch_depth=1, resident_blocks=(0, 2)),
            "resident-eager": Plan(micro_batch_size=1, optimizer_mode="eager", host_grad_slabs=2,
                                   resident_blocks=(0, 1))}
BATCH, SEQ = 6, 8  # global batch: divides among 2 and 3 ranks


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _rank_buffers(rank: int, world: int, cases: list[tuple[str, str]]) -> list[dict[str, int]]:
    return [_buffers(rank, world, name, plan_name) for name, plan_name in cases]


def _buffers(rank: int, world: int, name: str, plan_name: str) -> dict[str, int]:
    from megatrain.runtime import Engine, ModelConfig, OptimizerConfig

    hf, plan = HF[name], {**PLANS, **RESIDENT}[plan_name]
    clip = 1.0 if plan.optimizer_mode == "deferred" else None
    with Engine(ModelConfig.from_hf(hf), OptimizerConfig(max_grad_norm=clip), plan=plan, compute_dtype=torch.float32,
                device="cpu") as engine:
        ids = torch.randint(0, hf["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        share = BATCH // world
        engine.step(ids[rank * share:(rank + 1) * share], ids[rank * share:(rank + 1) * share])
        store, ex, coll = engine.store, engine.executor, engine.collectives
        arena = lambda a: 0 if a is None else a.nbytes  # noqa: E731
        return {"weight slots": _nbytes(ex.slots.buffers), "grad accumulators": _nbytes(ex.grad_buffers.buffers),
                "tied embedding grad": 0 if ex.tied_grad is None else _nbytes([ex.tied_grad]),
                "gradient shards": _nbytes(coll.grad_shards), "fp32 master": arena(store.master),
                "Adam m": arena(store.exp_avg), "Adam v": arena(store.exp_avg_sq),
                "fp32 grads (full arena)": arena(store.grads),
                "fp32 grad slabs": 0 if store.slabs is None else store.slabs.arena.nbytes, "store": store.nbytes,
                "resident optimizer state": 0 if store.resident is None else store.resident.nbytes,
                "host checkpoints": ex.checkpoints.host_bytes if plan.checkpoints == "host" else 0}


@pytest.mark.parametrize("world", [2, 3])
def test_the_planners_rank_is_the_runtimes_rank_buffer_by_buffer(world: int, tmp_path):
    _agree(PLANS, world, tmp_path)


def test_a_ranks_resident_shards_are_the_planners(tmp_path):
    """Two ranks with resident blocks: the device state of each rank's shards, its host arenas without them, the
    accumulators that still carry the resident blocks' gradients, the planner's terms one by one."""
    _agree(RESIDENT, 2, tmp_path)


def _agree(plans: dict[str, Plan], world: int, tmp_path) -> None:
    hw = detect()
    assert hw.device_is_host  # CPU ranks (gloo): no gradient shards, no collective staging
    cases = [(name, plan_name) for name in sorted(HF) for plan_name in sorted(plans)]
    ranks = run_ranks(_rank_buffers, world, tmp_path, cases, timeout_s=600)
    for i, (name, plan_name) in enumerate(cases):
        plan = plans[plan_name]
        work = Workload(seq_len=SEQ, batch=BATCH, compute_dtype="fp32", clipping=plan.optimizer_mode == "deferred")
        est = data_parallel.memory(model_shapes.from_config(HF[name]), work, plan, hw,
                                   data_parallel.topology(hw, world, 1))
        planned = {c.name: c.nbytes for c in est.components}
        assert planned["collective staging"] == 0
        for got in (r[i] for r in ranks):
            for buffer in ("weight slots", "grad accumulators", "tied embedding grad", "gradient shards",
                           "fp32 master", "Adam m", "Adam v", "fp32 grads (full arena)", "fp32 grad slabs",
                           "resident optimizer state"):
                assert planned.get(buffer, 0) == got[buffer], (name, plan_name, buffer, planned.get(buffer), got)
            if plan.checkpoints == "host":
                assert planned["activation checkpoints"] == got["host checkpoints"]
            host = sum(c.nbytes for c in est.components if c.where == "host" and c.name not in (
                "process", "allocator retention", "activation checkpoints"))
            assert host == got["store"], (name, plan_name)  # every host buffer of the store is a term, nothing else


def _peak_growth(work) -> int:
    """Bytes by which ``work()`` raised this process's peak RSS above its RSS before (the peak reset first)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
    before = status("VmRSS")
    work()
    return status("VmHWM") - before


def _collectives_memory(rank: int, world: int) -> dict:
    from megatrain.runtime.distributed.collectives import Collectives
    from megatrain.runtime.distributed.process_group import join
    from megatrain.runtime.model.templates import Templates
    from megatrain.runtime import ModelConfig, OptimizerConfig

    # An embedding of 16 MiB x W in fp32: a temporary of the whole block would show in the peak.
    config = ModelConfig.from_hf(dict(model_type="llama", vocab_size=8192 * world, hidden_size=512,
                                      intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=4))
    coll = Collectives(join(), Templates(config, OptimizerConfig().decays).blocks, torch.device("cpu"), 2)
    b = 0
    slot = torch.zeros(coll.shards.slot_numel)
    grads = torch.full((coll.shards.padded(b),), float(rank + 1))
    gathered = _peak_growth(lambda: coll.fill_slot(b, slot, lambda own: own.fill_(rank + 1)))
    s = coll.shards.numel(b)
    assert all(bool((slot[r * s:(r + 1) * s] == r + 1).all()) for r in range(world))
    holder: list = []
    reduced = _peak_growth(lambda: holder.append(coll.reduce_scatter(b, 0, grads)[0]))
    assert bool((holder[0] == world * (world + 1) / 2).all())
    return {"block": grads.nbytes, "gather": gathered, "reduce": reduced}


@pytest.mark.parametrize("world", [2, 3])
def test_a_cpu_ranks_collectives_allocate_no_block_sized_buffer(world: int, tmp_path):
    for got in run_ranks(_collectives_memory, world, tmp_path):
        # gloo's own gather and reduce-scatter each allocated a whole padded block (64 MiB on 64 MiB, measured)
        assert got["gather"] < got["block"] // 8 and got["reduce"] < got["block"] // 8, got


def _resident_after_frees(rank: int, world: int) -> dict[str, int]:
    """Bytes still resident after temporaries are freed, in a fresh process (glibc's thresholds at their start)."""
    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))

    def kept(numel: int) -> int:
        before = rss()
        t = torch.ones(numel)  # every page touched
        del t
        return rss() - before

    kept(1024)  # torch's first use of the allocator
    first = kept(4 * 2**20)  # 16 MiB: mmapped, and unmapped when freed; the mmap threshold rises to it
    then = kept(2 * 2**20)  # 8 MiB: now carved from the heap, whose top is kept below 2 x 16 MiB
    huge = kept(12 * 2**20)  # 48 MiB: above glibc's 32 MiB ceiling, always mmapped
    return {"first": first, "then": then, "huge": huge}


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or any(k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"
                                                             for k in os.environ),
                    reason="glibc's malloc with its default thresholds")
def test_the_allocator_retention_term_is_glibcs_heap_top_by_hand(tmp_path):
    """[Note: allocator retention] in planner/costs/allocator_retention.py: 4 x min(max(V, I) x h x c, 32 MiB) on a CPU device,
    the same at every W; and the glibc behaviour it stands on, in a fresh process."""
    hw = detect()
    model = model_shapes.from_config(HF["untied"])
    for world in (1, 3):
        est = data_parallel.memory(model, Workload(seq_len=SEQ, batch=BATCH, compute_dtype="fp32"), PLANS["default"],
                                   hw, data_parallel.topology(hw, world, 1))
        assert {c.name: c.nbytes for c in est.components}["allocator retention"] == 4 * 517 * 40 * 4
    got = run_ranks(_resident_after_frees, 1, tmp_path, start="spawn")[0]  # a new interpreter's malloc
    mib = 2**20
    assert got["first"] < mib and got["huge"] < mib, got  # unmapped
    assert 6 * mib <= got["then"] <= 2 * 16 * mib, got  # kept at the heap's top, below the trim threshold (2 x 16)

