"""The planner's memory model against what the runtime really allocates, buffer by buffer.

The planner never imports the runtime, so nothing but this test keeps the two in step:
model sizes, device slots, gradient buffers, host arenas and checkpoint buffers must be
the bytes the Engine holds; a sequence tile saves memory in the planner where the runtime's
graphs hold less. And a plan chosen by the planner for this machine runs.
"""
from __future__ import annotations

import weakref

import pytest
import torch

from megatrain.planner.costs import memory_model
from megatrain.planner.shapes import model_shapes
from megatrain.planner.choice import search
from megatrain.plan.buffer_kinds import BufferKind
from megatrain.planner.profiling.hardware import HardwareProfile, preset
from megatrain.plan.plan import Plan
from megatrain.planner.profiling.profiler import detect
from megatrain.planner.shapes.workload import Workload
from megatrain.runtime import Engine, ModelConfig, OptimizerConfig

CONFIGS = {
    "llama-bias": dict(model_type="llama", vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                       num_attention_heads=6, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
    # vocabulary 300: the tied embedding (9,600 elements) is the largest block, the accumulators a layer's (7,232)
    "qwen2-tied": dict(model_type="qwen2", vocab_size=300, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=12),
    "mistral": dict(model_type="mistral", vocab_size=90, hidden_size=40, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=5, num_key_value_heads=5),
}
SPILL_DIR = "@spill@"  # replaced by a temporary directory
PLANS = [Plan(), Plan(num_slots=3, prefetch_depth=2, checkpoints="host", device_grad_buffers=3),
         # Host checkpoints in pieces of 5 tokens (micro-batches of 2 x 8 and 1 x 8 tokens: pieces cut rows).
         Plan(checkpoints="host", micro_batch_size=2, checkpoint_piece_tokens=5),
         Plan(optimizer_mode="eager", host_grad_slabs=2, micro_batch_size=2),
         Plan(spill="optimizer", spill_dir=SPILL_DIR, spill_staging=2),
         Plan(spill="all", spill_dir=SPILL_DIR, spill_staging=3, host_grad_slabs=3),
         Plan(spill="all", spill_dir=SPILL_DIR, optimizer_mode="eager", spill_staging=1),
         # 4 KiB chunks: every spill buffer is one chunk, far below the largest block.
         Plan(spill="all", spill_dir=SPILL_DIR, spill_staging=2, host_grad_slabs=2, spill_chunk_bytes=4096),
         Plan(spill="optimizer", spill_dir=SPILL_DIR, spill_staging=3, spill_chunk_bytes=8192),
         # Per block: each kind's RAM arena holds the blocks not named, each file only those named.
         Plan(spill="blocks", spill_dir=SPILL_DIR, spill_staging=2, spill_chunk_bytes=4096,
              spill_blocks={"master": [1, 3], "exp_avg": [0, 1], "exp_avg_sq": [3], "grads": [2]}),
         # Kept layers ([Note: kept layers]): no checkpoint for layer 0 (host: one row less), or none at all.
         Plan(checkpoints="host", micro_batch_size=2, kept_layers=(0,)),
         Plan(checkpoints="host", kept_layers=(0, 1)),
         # A CPU device computing in place ([Note: compute in place]): no slot, accumulator or tied buffer of its own.
         Plan(compute_in_place=True, adam_thread="compute", kept_layers=(0,)),
         # The weights rounded on the device: no shadow, the master is what the loads copy (bf16; fp32 has neither).
         Plan(weights_cast="device"), Plan(weights_cast="device", optimizer_mode="eager", spill="optimizer",
                                           spill_dir=SPILL_DIR, spill_staging=2),
         # Optimizer state on the device ([Note: resident blocks]): 16 bytes a resident parameter there, none of it
         # in RAM; the accumulators and slabs the size of the largest block left on the host, none when none is.
         Plan(resident_blocks=(0, 2), checkpoints="host"), Plan(optimizer_mode="eager", resident_blocks=(1, 3)),
         Plan(resident_blocks=(0, 1, 2, 3), kept_layers=(0,))]


# The host arenas copied to or from the GPU (pinned there), by compute dtype: m and v never; the master only where
# it is the weights the loads copy (fp32, or any dtype with the cast on the device, as fp32 here); the bf16 shadow,
# the gradients and their slabs always.
CROSSING = {torch.float32: {"fp32 master", "fp32 grads", "gradient slabs"},
            torch.bfloat16: {"shadow", "fp32 grads", "gradient slabs"}}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("plan", PLANS, ids=["default", "host-ckpt", "host-ckpt-pieces", "eager", "spill-opt",
                                         "spill-all", "spill-eager", "spill-all-4k", "spill-opt-8k", "spill-blocks",
                                         "host-ckpt-kept-0", "host-ckpt-kept-all", "in-place", "cast-on-device",
                                         "cast-on-device-eager-spill-opt", "resident-some", "resident-eager",
                                         "resident-all"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_memory_model_matches_allocations(name: str, plan: Plan, dtype: torch.dtype, tmp_path,
                                          state: str = "fp32") -> None:
    if plan.spill_dir == SPILL_DIR:
        plan = plan.replace(spill_dir=str(tmp_path))
    hf = CONFIGS[name]
    shape = model_shapes.from_config(hf)
    batch, seq = 3, 8
    work = Workload(seq_len=seq, batch=batch, compute_dtype="fp32" if dtype == torch.float32 else "bf16",
                    clipping=plan.optimizer_mode == "deferred", optimizer_state=state)
    est = {c.name: c.nbytes for c in memory_model.estimate(shape, work, plan).components}
    clip = 1.0 if plan.optimizer_mode == "deferred" else None
    with Engine(ModelConfig.from_hf(hf), OptimizerConfig(max_grad_norm=clip, state_dtype=state), plan=plan,
                compute_dtype=dtype, device="cpu") as engine:
        assert shape.params == engine.num_parameters
        store, ex = engine.store, engine.executor
        assert shape.numel_total == store.total_numel
        assert shape.numel_largest_block == store.max_block_numel
        assert est["weight slots"] == sum(_nbytes(b) for b in ex.slots.buffers)
        assert est["grad accumulators"] == sum(_nbytes(b) for b in ex.grad_buffers.buffers)
        tied = ex.tied_grad  # a buffer of its own, or (in place) a view of the host gradients
        held = [a.tensor for a in (store.grads,) if a is not None] + (
            [store.resident.buffers[BufferKind.GRADS]] if store.resident is not None else [])
        own = tied is not None and tied.untyped_storage().data_ptr() not in {
            t.untyped_storage().data_ptr() for t in held}  # not the host gradients' or a resident block's own
        assert est.get("tied embedding grad", 0) == (_nbytes(tied) if own else 0)
        assert est.get("resident optimizer state", 0) == (0 if store.resident is None else store.resident.nbytes)
        ram = lambda arena: 0 if arena is None else arena.nbytes  # noqa: E731
        assert est.get("fp32 master", 0) == ram(store.master)
        assert est.get("Adam m", 0) == ram(store.exp_avg) and est.get("Adam v", 0) == ram(store.exp_avg_sq)
        assert est.get("compute-dtype shadow", 0) == (0 if store.shadow in (store.master, None) else store.shadow.nbytes)
        nvme = sum(c.nbytes for c in memory_model.estimate(shape, work, plan).components if c.where == "nvme")
        assert nvme == store.nvme_bytes
        staging = 0 if store.staging is None else sum(_nbytes(t) for s in store.staging._sets for t in s.values())
        assert est.get("spill staging", 0) == staging
        assert est.get("fp32 grads (full arena)", 0) == (store.grads.nbytes if store.grads is not None else 0)
        assert est.get("fp32 grad slabs", 0) == (store.slabs.arena.nbytes if store.slabs is not None else 0)
        listed = sum(c.nbytes for c in memory_model.estimate(shape, work, plan).components
                     if c.where == "host" and c.name not in (*memory_model.FIXED_TERMS, "activation checkpoints"))
        assert listed == store.nbytes  # every host buffer of the store is a term, and nothing else is
        # Pinned with a GPU: what crosses PCIe, the planner's pinned terms and the store's arenas alike.
        full = memory_model.estimate(shape, work, plan)
        pinned = full.pinned_host_bytes - sum(c.nbytes for c in full.components
                                              if c.name == "activation checkpoints" and c.where == "host")
        assert pinned == store.pcie_bytes
        assert store.pinned_bytes == 0 == ex.checkpoints.pinned_bytes  # nothing is registered with a driver on the CPU
        crossing = CROSSING[torch.float32 if plan.weights_cast == "device" else dtype]
        assert {a.name: a.crosses_pcie for a in store.arenas()} == {a.name: a.name in crossing for a in store.arenas()}
        ids = torch.randint(0, hf["vocab_size"], (batch, seq))
        engine.step(ids, ids)
        if plan.checkpoints == "host":
            ckpt = ex.checkpoints
            assert est["activation checkpoints"] == ckpt.host_bytes
            assert est["checkpoint staging"] == sum(_nbytes(s) for s in ckpt.staging)
            # What the drains held at once: forward's inputs referenced until their pieces were on the host.
            assert est["checkpoint drains in flight"] == ckpt.held_peak_bytes
        assert est.get("kept activations", 0) == ex.kept.held_bytes


# Which layers are kept, with how many micro-batches (4 x 8 tokens): some, all, one of three micro-batches' worth.
KEPT_PLANS = [Plan(kept_layers=(1,)), Plan(micro_batch_size=2, kept_layers=(0, 1)),
              Plan(micro_batch_size=3, kept_layers=(0,), checkpoints="host")]


@pytest.mark.parametrize("plan", KEPT_PLANS, ids=["one", "all-2-micro", "host-uneven-micro"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kept_activations_match_what_the_graphs_hold(name: str, plan: Plan, dtype: torch.dtype) -> None:
    """The memory model's kept activations are the bytes the kept layers' graphs hold at the end of forward
    (each storage once, the weights never: they are re-read from the slot), and the boundary checkpoints it
    counts are those of the other layers."""
    hf = CONFIGS[name]
    shape = model_shapes.from_config(hf)
    batch, seq = 4, 8
    work = Workload(seq_len=seq, batch=batch, compute_dtype="fp32" if dtype == torch.float32 else "bf16")
    est = {c.name: c.nbytes for c in memory_model.estimate(shape, work, plan).components}
    with Engine(ModelConfig.from_hf(hf), OptimizerConfig(max_grad_norm=1.0), plan=plan, compute_dtype=dtype,
                device="cpu") as engine:
        ids = torch.randint(0, hf["vocab_size"], (batch, seq))
        engine.step(ids, ids)
        ex = engine.executor
        assert est["kept activations"] == ex.kept.held_bytes > 0
        if plan.checkpoints == "host":
            assert est["activation checkpoints"] == ex.checkpoints.host_bytes
            assert est["checkpoint drains in flight"] == ex.checkpoints.held_peak_bytes


# bf16 AdamW state: m and v in RAM, or in spill files at 2 bytes per element (chunks of 4 MiB multiples); the master
# and grads alone take any chunk.
BF16_STATE_PLANS = [PLANS[0], PLANS[3], Plan(spill="blocks", spill_dir=SPILL_DIR, spill_staging=2, spill_chunk_bytes=4096,
                                             spill_blocks={"master": [1, 3], "grads": [2]}),
                    Plan(spill="optimizer", spill_dir=SPILL_DIR, spill_staging=3, spill_chunk_bytes=4 * 2**20),
                    Plan(spill="all", spill_dir=SPILL_DIR, spill_staging=2, host_grad_slabs=2,
                         spill_chunk_bytes=4 * 2**20),
                    Plan(spill="blocks", spill_dir=SPILL_DIR, spill_staging=2, spill_chunk_bytes=4 * 2**20,
                         spill_blocks={"master": [1], "exp_avg": [0, 1], "exp_avg_sq": [3], "grads": [2]})]


@pytest.mark.parametrize("plan", BF16_STATE_PLANS, ids=["default", "eager", "spill-master-grads", "spill-opt",
                                                        "spill-all", "spill-blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bf16_state_memory_matches_allocations(plan: Plan, dtype: torch.dtype, tmp_path) -> None:
    """m and v at 2 bytes per element, buffer by buffer as above."""
    test_memory_model_matches_allocations("llama-bias", plan, dtype, tmp_path, state="bf16")


def test_a_plan_from_the_planner_runs_here() -> None:
    hf = CONFIGS["llama-bias"]
    hw = detect()
    assert isinstance(hw, HardwareProfile)
    work = Workload(seq_len=16, batch=4, compute_dtype="fp32", clipping=True)
    result = search.search(model_shapes.from_config(hf), work, hw)
    assert result.best is not None, result
    plan = Plan.from_json(result.best.plan.to_json())
    with Engine(ModelConfig.from_hf(hf), OptimizerConfig(max_grad_norm=1.0), plan=plan,
                compute_dtype=torch.float32) as engine:
        ids = torch.randint(0, hf["vocab_size"], (4, 16))
        losses = [engine.step(ids, ids).item() for _ in range(3)]
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_spilling_never_needs_more_ram(name: str, dtype: torch.dtype, tmp_path) -> None:
    """With chunks smaller than the largest block, spilling more holds less in RAM, in the runtime's arenas and in
    the memory model alike (staging sets, slabs and the fp32 weights bounded by the chunk, not the block)."""
    hf = CONFIGS[name]
    shape = model_shapes.from_config(hf)
    work = Workload(seq_len=8, batch=3, compute_dtype="fp32" if dtype == torch.float32 else "bf16", clipping=True)
    host = {}
    for spill in ("none", "optimizer", "all"):
        plan = Plan(spill=spill, spill_dir=None if spill == "none" else str(tmp_path), spill_staging=3,
                    spill_chunk_bytes=4096)
        est = memory_model.estimate(shape, work, plan)
        with Engine(ModelConfig.from_hf(hf), OptimizerConfig(max_grad_norm=1.0), plan=plan, compute_dtype=dtype,
                    device="cpu") as engine:
            host[spill] = (engine.store.nbytes, memory_model.listed_host_bytes(est, device_is_host=False))
    assert host["all"][0] < host["optimizer"][0] < host["none"][0]
    assert host["all"][1] < host["optimizer"][1] < host["none"][1]


def test_spill_terms_for_a_3b_model_are_bounded_by_the_chunk() -> None:
    """Llama-3.2-3B in fp32, spill all, 64 MiB chunks: no shadow, and the spill buffers are P x k + S chunks (by hand)."""
    shape = model_shapes.resolve("shape:Llama-3.2-3B")
    work = Workload(seq_len=512, batch=1, compute_dtype="fp32", clipping=True)
    plan = Plan(spill="all", spill_dir="/tmp", spill_staging=3, host_grad_slabs=2, spill_chunk_bytes=64 * 2**20)
    est = {c.name: c.nbytes for c in memory_model.estimate(shape, work, plan).components}
    assert "compute-dtype shadow" not in est and "fp32 master" not in est
    assert est["spill staging"] == 3 * 4 * 64 * 2**20
    assert est["fp32 grad slabs"] == 2 * 64 * 2**20


class _GraphBytes:
    """The bytes autograd's graphs save (each saved tensor's, released with its graph) and their peak: what a layer's
    working set is made of, the runtime's side of ``memory_model.layer_working_set``."""

    def __init__(self) -> None:
        self.held = self.peak = 0

    def pack(self, t: torch.Tensor) -> tuple[object, torch.Tensor]:
        n = t.numel() * t.element_size()
        self.held += n
        self.peak = max(self.peak, self.held)
        token = _Token()  # held by the graph with the tensor: its finalizer runs when the graph lets both go
        weakref.finalize(token, self._release, n)
        return token, t

    def _release(self, n: int) -> None:
        self.held -= n


class _Token:
    """A saved tensor's handle."""


def _graph_peak(config: dict, plan: Plan, rows: int, seq: int) -> int:
    bytes_ = _GraphBytes()
    with Engine(ModelConfig.from_hf(config), OptimizerConfig(max_grad_norm=1.0), plan=plan, compute_dtype=torch.float32,
                device="cpu", seed=0) as engine:
        ids = torch.randint(0, config["vocab_size"], (rows, seq), generator=torch.Generator().manual_seed(0))
        with torch.autograd.graph.saved_tensors_hooks(bytes_.pack, lambda packed: packed[1]):
            engine.step(ids, ids)
    return bytes_.peak


def test_mlp_tiles_save_memory_in_the_planner_where_the_runtime_tiles() -> None:
    """``mlp_tile_tokens`` lowers the layer working set the planner counts exactly where the runtime's graphs hold
    less: a sparse layer streamed whole runs its MLP (the experts) in tiles, one streamed in expert groups runs its
    experts over all routed tokens at once (the tile changes neither side); and the search never pairs groups
    with MLP tiles."""
    config = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=96, norm_topk_prob=True)
    shape = model_shapes.from_config(config)
    rows, seq = 2, 32
    work = Workload(seq_len=seq, batch=rows, compute_dtype="fp32", clipping=True)
    for group in (None, 2):
        plan = Plan(micro_batch_size=rows, loss_chunk_tokens=8, expert_group_size=group)
        tiled = plan.replace(mlp_tile_tokens=4)
        planned = [memory_model.layer_working_set(shape, work, p)[0] for p in (plan, tiled)]
        held = [_graph_peak(config, p, rows, seq) for p in (plan, tiled)]
        if group is None:
            assert planned[1] < planned[0] and held[1] < held[0], (planned, held)
        else:
            assert planned[1] == planned[0] and held[1] == held[0], (planned, held)

    # megatrain-plan plan --model shape:Qwen3-235B-A22B --gpu-mem 24G --ram 8T --seq-len 8192: layers too large
    # for the device, sequences long enough for tiles
    long = Workload(seq_len=8192, batch=2, compute_dtype="bf16", clipping=True, spill="none")
    hw = preset("H100-SXM", "server-2t").replace(gpu_mem_bytes=24 * 2**30, host_ram_bytes=8 * 2**40,
                                                 host_available_bytes=8 * 2**40)
    best = search.search(model_shapes.resolve("shape:Qwen3-235B-A22B"), long, hw).best
    assert best is not None and best.plan.expert_group_size and best.plan.attention_tile_tokens
    assert best.plan.mlp_tile_tokens is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["deferred", "eager"])
@pytest.mark.parametrize("checkpoints", ["device", "host"])
def test_pinned_arenas_on_cuda_are_the_planners_pinned_terms(mode, checkpoints):
    """With CUDA the store registers exactly the arenas that cross PCIe, and they are the planner's pinned bytes;
    after a step, with the host checkpoints' arena (every layer recomputed) the engine's pinned bytes are."""
    hf = CONFIGS["llama-bias"]
    plan = Plan(optimizer_mode=mode, checkpoints=checkpoints, kept_layers=())
    shape = model_shapes.from_config(hf)
    work = Workload(8, 4, compute_dtype="bf16", clipping=mode == "deferred")
    est = memory_model.estimate(shape, work, plan)
    with Engine(ModelConfig.from_hf(hf), OptimizerConfig(max_grad_norm=1.0 if mode == "deferred" else None),
                plan=plan, compute_dtype=torch.bfloat16, device="cuda") as engine:
        assert engine.store.pinned_bytes == engine.store.pcie_bytes > 0
        ckpt = sum(c.nbytes for c in est.components if c.name == "activation checkpoints" and c.where == "host")
        assert engine.store.pinned_bytes == est.pinned_host_bytes - ckpt
        ids = torch.randint(0, hf["vocab_size"], (4, 8))
        engine.step(ids, ids)
        assert (ckpt > 0) == (checkpoints == "host")
        assert engine.store.pinned_bytes + engine.executor.checkpoints.pinned_bytes == est.pinned_host_bytes
