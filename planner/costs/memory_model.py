"""Memory model: every buffer the runtime allocates for a Plan, component by component, then summed.

Never a max-of-stages shortcut: each component below is a buffer the runtime
holds for the whole step (or a transient that peaks inside one block), and the
totals are plain sums. Symbols used in the formulas:

  N   elements of all distinct blocks' flat buffers (params, each offset aligned to 64 elements)
  Bmax elements of the largest block; E the embedding block's elements
  Bu  elements of one slot: Bmax, or with expert groups the largest part streamed (``slot_numel``)
  Bg  elements of one device gradient accumulator: Bu, but with a tied embedding the largest unit but the
      embedding (whose gradient has its own buffer: ``grad_numel``)
  L   decoder layers; h hidden size; V vocab size; k the layers the plan keeps (``Plan.kept_layers``), whose
      activations stay for backward instead of a checkpoint (kept_layers.py: a bytes per token)
  T   global batch tokens per step (batch x seq); t micro-batch tokens (micro_batch_size x seq)
  c   compute dtype bytes (2 for bf16/fp16, 4 for fp32)
  K   plan.num_slots; G plan.device_grad_buffers; S plan.host_grad_slabs
  P   plan.spill_staging; Ck elements of one spill chunk: min(plan.spill_chunk_bytes, Bmax x 4 rounded up to
      4 KiB) / 4 (buffer_kinds.spill_chunk_numel); k the number of kinds with a block on disk
  s_k bytes per element of kind k: 4, or s (the AdamW state's: 4, or 2 in bf16) for m and v, in RAM and on disk
  Nr  elements of the plan's resident blocks (``Plan.resident_blocks``: master, m, v and gradient on the device);
      Bh the largest block not resident
  Ns_k elements of kind k whose blocks the plan spills (spill_placement.Spilled: every block for a
      shorthand's kinds); F_k its spill file: sum over those blocks of (block x s_k rounded up to 4 KiB)

Pure stdlib.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from megatrain.plan import buffer_kinds
from megatrain.planner.costs import kept_layers, resident_blocks, sparse_working_set, spill_placement
from megatrain.planner.costs.allocator_retention import allocator_retention
from megatrain.planner.costs.attention_memory import attention_working_set
from megatrain.plan.buffer_kinds import (BufferKind, crosses_pcie, has_shadow, load_bytes, spill_block_bytes,
                                         spill_chunk_numel)
from megatrain.planner.profiling.hardware import GiB, HardwareProfile
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan
from megatrain.planner.costs.stream_units import grad_numel, grouped, slot_numel
from megatrain.planner.shapes.workload import Workload

# The CUDA context, cuBLAS workspaces and kernels' own memory: a constant until fitted from runs.
CUDA_CONTEXT_BYTES = 1 * GiB
# Caching-allocator fragmentation on the device: a fraction of the device tensors, fitted later.
ALLOCATOR_SLACK_FRACTION = 0.05
# The host process itself: Python, torch libraries, the data loader (not pinned), fitted later. With a GPU,
# the CUDA libraries and the context's host side are most of it.
HOST_PROCESS_BYTES = 2 * GiB
# The same without a GPU: Python and torch's CPU libraries only. Peak resident bytes of a process that ran an
# engine's first steps, less its tensors: 0.30 GiB measured (one process and each of 2 gloo ranks, a 0.4M-parameter
# model whose buffers are 6-11 MiB; 0.22 GiB of it before the engine, the rest the engine's libraries and the step's
# kernels; torch 2.13 CPU build); the step's transients are the device terms (the device is the host).
HOST_PROCESS_BYTES_CPU = 312 * 2**20

WHERE = ("device", "host", "nvme")


@dataclass(frozen=True, init=False)
class Component:
    """One buffer (or group of equal buffers) the runtime allocates."""

    name: str
    where: str          # "device", "host" or "nvme"
    nbytes: int
    formula: str        # how nbytes was computed, for tables and review
    pinned: bool = False

    def __init__(self, name: str, where: str, nbytes: int, formula: str, pinned: bool = False) -> None:
        # Written through __dict__: a frozen dataclass's own __init__ sets each field through object.__setattr__, 3.7x
        # slower, and an estimate makes about 25 of these (a search: tens of thousands of estimates).
        assert where in WHERE, where
        assert nbytes >= 0, (name, nbytes)
        self.__dict__.update(name=name, where=where, nbytes=nbytes, formula=formula, pinned=pinned)


@dataclass(frozen=True, init=False)
class Overrun:
    """A budget and what a plan needs of it: which one, what it needs, what there is; an overrun where the need is
    the larger (``excess`` > 0). ``MemoryEstimate.demands`` lists every budget, ``overruns`` those exceeded."""

    budget: str         # "gpu memory", "host RAM", "NVMe"
    needed: int
    available: int

    def __init__(self, budget: str, needed: int, available: int) -> None:
        self.__dict__.update(budget=budget, needed=needed, available=available)  # as Component's: a search makes many

    @property
    def excess(self) -> int:
        return self.needed - self.available

    def message(self) -> str:
        return (f"{self.budget}: needs {self.needed / GiB:.2f} GiB, has {self.available / GiB:.2f} GiB "
                f"(short by {self.excess / GiB:.2f} GiB)")


@dataclass(frozen=True)
class MemoryEstimate:
    components: tuple[Component, ...]

    def total(self, where: str) -> int:
        return self._totals.get(where, 0)

    @functools.cached_property
    def _totals(self) -> dict[str, int]:
        """Bytes per place, summed once (the search asks an estimate's totals against every budget)."""
        out: dict[str, int] = {}
        for c in self.components:
            out[c.where] = out.get(c.where, 0) + c.nbytes
        return out

    @property
    def device_bytes(self) -> int:
        return self.total("device")

    @property
    def host_bytes(self) -> int:
        return self.total("host")

    @property
    def pinned_host_bytes(self) -> int:
        return sum(c.nbytes for c in self.components if c.where == "host" and c.pinned)

    @property
    def nvme_bytes(self) -> int:
        return self.total("nvme")

    def demands(self, hw: HardwareProfile) -> list[Overrun]:
        """What this estimate needs of each budget on ``hw``, exceeded or not. Without a GPU, device buffers live in
        host RAM."""
        if hw.device_is_host:
            return [Overrun("host RAM", self.device_bytes + self.host_bytes, hw.host_budget_bytes)]
        return [Overrun("gpu memory", self.device_bytes, hw.gpu_mem_bytes),
                Overrun("host RAM", self.host_bytes, hw.host_budget_bytes)]

    def overruns(self, hw: HardwareProfile) -> list[Overrun]:
        """Budgets this estimate exceeds on ``hw``."""
        return [d for d in self.demands(hw) if d.excess > 0]

    def rows(self) -> list[dict[str, object]]:
        return [{"name": c.name, "where": c.where, "bytes": c.nbytes, "pinned": c.pinned, "formula": c.formula}
                for c in self.components]


def estimate(model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile | None = None) -> MemoryEstimate:
    """Every buffer of ``plan`` for ``model`` and ``work``. ``hw`` decides whether the device is a GPU
    (CUDA context, allocator slack, pinned host arenas) or the CPU itself, and, where it carries a
    calibration for the compute dtype, the fixed terms (process baseline, temporaries) are its fitted ones.
    ``work.nonblocking_saves``: the run saves checkpoints without blocking (``checkpoint_snapshot``)."""
    on_gpu = hw is None or not hw.device_is_host
    c = work.compute_bytes
    h, V = model.hidden_size, model.vocab_size
    N, Bmax, E = model.numel_total, model.numel_largest_block, model.numel_embedding
    T = work.tokens
    t = min(plan.micro_batch_size, work.batch) * work.seq_len
    K, G, S = plan.num_slots, plan.device_grad_buffers, plan.host_grad_slabs
    comps: list[Component] = []

    def dev(name: str, nbytes: int, formula: str) -> None:
        comps.append(Component(name, "device", int(nbytes), formula))

    def host(name: str, nbytes: int, formula: str, pinned: bool = True) -> None:
        comps.append(Component(name, "host", int(nbytes), formula, pinned=pinned and on_gpu))

    # ---- device -----------------------------------------------------------------------------
    Bu, unit = slot_numel(model, plan)
    if plan.compute_in_place:  # a CPU device computing on the host's weights and gradients: nothing copied
        dev("weight slots", 0, "0: compute in place")
        dev("grad accumulators", 0, "0: compute in place")
    else:
        dev("weight slots", K * Bu * c, f"K x {unit} x c = {K} x {Bu} x {c}")
        if on_gpu and c != 4 and plan.weights_cast == "device":  # the copy's fp32 landing, rounded into the slot
            dev("weight cast staging", Bu * 4, f"{unit} x 4 = {Bu} x 4")
        Bg, g_unit = grad_numel(model, plan)
        dev("grad accumulators", G * Bg * 4, f"G x {g_unit} x 4 = {G} x {Bg} x 4")
    if grouped(model, plan):
        dev("expert-group routed state", *sparse_working_set.routed_state(model, work, plan))
    if model.experts.num_experts:
        dev("routing statistics", *sparse_working_set.routing_statistics(model))
    Nr = resident_blocks.resident_numel(model, plan)
    if plan.resident_blocks:  # [Note: resident blocks]: fp32 master, m, v and gradient of each resident block
        dev("resident optimizer state", 16 * Nr, f"16 x Nr = 16 x {Nr}")
    if model.tie_word_embeddings:
        # The head's gradient of the shared weight waits here until the embedding's backward (in place: in the
        # embedding's host gradients; a resident embedding: in its own, counted above).
        own = "0: compute in place" if plan.compute_in_place else "0: resident" if 0 in plan.resident_blocks else None
        dev("tied embedding grad", 0 if own else E * 4, own or f"E x 4 = {E} x 4")
    R = kept_layers.recomputed_layers(model, plan)  # L - k: the layers with a boundary checkpoint
    if plan.checkpoints == "device":
        dev("activation checkpoints", R * T * h * c, f"(L - k) x T x h x c = {R} x {T} x {h} x {c}")
    else:
        # The runtime's [Note: host checkpoints in pieces]: the recompute reads a micro-batch's whole input, so
        # it comes back into one of two reload buffers of t x h; the drains read forward's inputs in place and
        # hold one per micro-batch (T x h in all) until their last piece is on the host. Pieces add nothing.
        dev("checkpoint staging", 2 * t * h * c, f"2 x t x h x c = 2 x {t} x {h} x {c}")
        dev("checkpoint drains in flight", T * h * c if R else 0, f"T x h x c = {T} x {h} x {c} (none if k = L)")
    if plan.kept_layers:  # [Note: kept layers]: what their forward graphs hold until their backward
        dev("kept activations", *kept_layers.kept_activation_bytes(model, work, plan))
    # dy for every micro-batch at the block boundary being back-propagated (both placements).
    dev("activation grad", T * h * c, f"T x h x c = {T} x {h} x {c}")
    dev("layer working set", *layer_working_set(model, work, plan))
    # with the attention half in tiles, the layer working set already holds dq, dk, dv for every head
    tiled = plan.attention_tile_tokens is not None and plan.attention_tile_tokens < work.seq_len
    dev("attention working set", *attention_working_set(model, work, plan, grads_counted=tiled))
    chunk = min(plan.loss_chunk_tokens, t)
    dev("logits chunk", chunk * model.logits_bytes_per_token(work.compute_dtype),
        f"chunk x V x (c + 12) = {chunk} x {V} x {c + 12}")
    if on_gpu:
        tensors = sum(x.nbytes for x in comps if x.where == "device")
        dev("allocator slack", tensors * ALLOCATOR_SLACK_FRACTION,
            f"{ALLOCATOR_SLACK_FRACTION} x device tensors = {ALLOCATOR_SLACK_FRACTION} x {tensors}")
        dev("CUDA context", CUDA_CONTEXT_BYTES, "constant, fitted from runs")

    # ---- host (and spill files) --------------------------------------------------------------
    spilled = spill_placement.Spilled.of(model, plan, work.state_bytes)
    for kind, label, s in ((BufferKind.MASTER, "fp32 master", 4), (BufferKind.EXP_AVG, "Adam m", work.state_bytes),
                           (BufferKind.EXP_AVG_SQ, "Adam v", work.state_bytes)):
        state_terms(kind, label, N - Nr, spilled, host, comps, size=s,
                    pinned=crosses_pcie(kind, load_bytes(c, plan.weights_cast) == 4))
    host_spill_terms(model, plan, c, spilled, host, comps)
    if plan.checkpoints == "host":
        host("activation checkpoints", R * T * h * c, f"(L - k) x T x h x c = {R} x {T} x {h} x {c}")
    cal = hw.fitted(work.compute_dtype) if hw is not None else None
    if cal is None:
        if on_gpu:
            host("process", HOST_PROCESS_BYTES, "constant: Python, torch, CUDA libraries, data loader", pinned=False)
        else:
            host("process", HOST_PROCESS_BYTES_CPU, "constant: Python, torch's CPU libraries (no GPU)", pinned=False)
            host("allocator retention", *allocator_retention(model, c), pinned=False)
    else:
        host("process", cal.process_bytes, "fitted: resident bytes before the engine (megatrain-plan calibrate)",
             pinned=False)
        # What autograd, the allocator and the loss keep beyond the listed buffers at the step's peak:
        # a + b x (layer working set + logits chunk), fitted from peak RSS growth.
        transient = transient_bytes(model, work, plan)
        host("temporaries", cal.temporaries(transient),
             f"fitted: a + b x (working set + logits chunk) = {cal.temporaries_bytes} + "
             f"{cal.temporaries_factor:.3f} x {transient}", pinned=False)
    if work.nonblocking_saves:
        comps.append(checkpoint_snapshot(model, work, spilled))
        comps.append(checkpoint_writer_staging(model))
    if not spilled.kinds:
        comps.append(Component("spill files", "nvme", 0, "0: nothing spills in this plan"))
    return MemoryEstimate(tuple(comps))


# The checkpoint writer's unit: one zarr shard of up to 2**26 elements (runtime/io/checkpoint_format.py's spec).
CHECKPOINT_SHARD_BYTES = 2**26 * 4


def checkpoint_writer_staging(model: ModelShape) -> Component:
    """What tensorstore holds while it writes one array's shard: the shard, min(4 x N, 256 MiB) (measured: a save's
    peak growth beyond its snapshot was 1.5 x one 64 MiB array on this CPU, within this term plus one more shard)."""
    n = min(4 * model.numel_total, CHECKPOINT_SHARD_BYTES)
    return Component("checkpoint writer staging", "host", n, f"min(4 x N, 256 MiB) = {n}", pinned=False)


def checkpoint_snapshot(model: ModelShape, work: Workload, spilled: "spill_placement.Spilled") -> Component:
    """A non-blocking checkpoint save's snapshot (runtime/io/training_checkpoint.py, [Note: asynchronous
    checkpoints]): copies of the master, m and v arenas held while the background write runs, (4 + 2 x s) x N
    (s: AdamW state bytes, 4, or 2 in bf16). None when the plan spills any kind (such a save writes from the store,
    blocking) or, in data parallelism, on a rank (its shards are written blocking). Blocks whose state is on the
    device are gathered into it too."""
    N, s = model.numel_total, work.state_bytes
    if spilled.kinds:
        return Component("checkpoint snapshot", "host", 0, "0: a plan that spills saves blocking", pinned=False)
    return Component("checkpoint snapshot", "host", (4 + 2 * s) * N, f"(4 + 2 x s) x N = {4 + 2 * s} x {N}",
                     pinned=False)


def state_terms(kind: BufferKind, label: str, N: int, spilled: "spill_placement.Spilled", host,
                comps: list[Component], file_label: str | None = None, size: int = 4, pinned: bool = True) -> None:
    """One kind's RAM arena and spill file: s x (N - Ns_k) bytes of RAM for the blocks in RAM (none when every
    block spills; s: 4, or 2 for bf16 AdamW state) and F_k bytes on disk for the others (the same s per element).
    ``pinned``: whether the arena crosses PCIe (``buffer_kinds.crosses_pcie``), pinned with a GPU."""
    Ns, F = spilled.numel(kind), spilled.file_bytes(kind)
    if Ns < N:
        host(label, size * (N - Ns),
             f"{size} x N = {size} x {N}" if not Ns else f"{size} x (N - Ns) = {size} x ({N} - {Ns})", pinned)
    if Ns:
        comps.append(Component(file_label or f"{label} (spill file)", "nvme", F,
                               f"sum over its spilled blocks of 4 KiB-rounded block x {size} = {F}"))


def host_spill_terms(model: ModelShape, plan: Plan, c: int, spilled: "spill_placement.Spilled",
                     host, comps: list[Component]) -> None:
    """The shadow, the gradients and the spill buffers in host RAM (and the grads spill file). Every spill
    buffer is bounded by one chunk (Ck), never by the largest block: spilling needs less RAM than not."""
    N, Bmax = model.numel_total, model.numel_largest_block
    Nr, Bh = resident_blocks.resident_numel(model, plan), resident_blocks.largest_host_block(model, plan)
    if Nr:  # [Note: resident blocks]: none of their state in RAM
        N, Bmax = N - Nr, Bh
    # In fp32, or with the cast on the device, the master is the weights that travel (fp32: a spilled one is read
    # from its file); else a compute-dtype shadow.
    if has_shadow(c, plan.weights_cast):
        host("compute-dtype shadow", c * N, f"c x N = {c} x {N}")
    Ck = spill_chunk_numel(Bmax, plan.spill_chunk_bytes)
    if plan.optimizer_mode == "deferred" and BufferKind.GRADS in spilled.kinds:
        state_terms(BufferKind.GRADS, "fp32 grads (full arena)", N, spilled, host, comps, "fp32 grads (spill file)")
        host("fp32 grad slabs", plan.host_grad_slabs * Ck * 4,
             f"S x Ck x 4 = {plan.host_grad_slabs} x {Ck} x 4")
    elif plan.optimizer_mode == "deferred":
        host("fp32 grads (full arena)", 4 * N, f"4 x N = 4 x {N}")
    else:
        host("fp32 grad slabs", plan.host_grad_slabs * Bmax * 4, f"S x Bmax x 4 = {plan.host_grad_slabs} x {Bmax} x 4")
    if spilled.kinds:
        # one buffer per spilled kind in a set: Ck x s_k rounded up to 4 KiB (fp32: Ck x 4 is a multiple of it)
        k = len(spilled.kinds)
        P = plan.spill_staging
        per_set = sum(spill_block_bytes(Ck, spilled.element_bytes(kind)) for kind in spilled.kinds)
        formula = (f"P x k x Ck x 4 = {P} x {k} x {Ck} x 4" if per_set == k * Ck * 4 else
                   f"P x sum over the k = {k} kinds of (Ck x s_k rounded up to 4 KiB) = {P} x {per_set}")
        host("spill staging", P * per_set, formula, pinned=False)


def transient_bytes(model: ModelShape, work: Workload, plan: Plan) -> int:
    """The step's transient device working set, what fitted temporaries scale with:
    layer working set + logits chunk (``layer_working_set`` + chunk x V x (c + 12))."""
    t = min(plan.micro_batch_size, work.batch) * work.seq_len
    chunk = min(plan.loss_chunk_tokens, t)
    return layer_working_set(model, work, plan)[0] + chunk * model.logits_bytes_per_token(work.compute_dtype)


def layer_working_set(model: ModelShape, work: Workload, plan: Plan) -> tuple[int, str]:
    """One layer's peak (backward after recompute) for one micro-batch, and its formula.

    Untiled: t x w + layer x c (w: ``layer_working_bytes_per_token``; autograd's per-parameter grads of
    one layer in compute dtype before they are added into fp32; with expert groups, of one part: layer is then
    min(layer, Bu)). With ``mlp_tile_tokens`` below the
    sequence, the MLP's share m (``mlp_working_bytes_per_token``) is held for one tile of
    u = micro-batch x tile tokens only, plus dh (t x h x c), the layer-input gradient the tiles fill:
    t x (w - m) + u x m + t x h x c + layer x c. With ``attention_tile_tokens`` below the sequence too, the
    attention half holds whole only q, k, v, its output and their gradients, h and dh
    (A = ``attention_whole_bytes_per_token``), and its token-local work for one tile of v tokens
    (a = ``attention_tile_bytes_per_token``): t x A + u x m + v x a + layer x c (u = t when the MLP is
    untiled). Layers in expert groups run their experts over a micro-batch's routed tokens in one go, whatever
    ``mlp_tile_tokens`` says (the runtime's [Note: expert groups]): their MLP counts untiled, u = t. A sparse layer
    untiled is its family's (``sparse_working_set.layer_working_set``: whole or in groups); tiled, its w and m are
    (``sparse_working_set.bytes_per_token``)."""
    c = work.compute_bytes
    mbs = min(plan.micro_batch_size, work.batch)
    t = mbs * work.seq_len
    layer_n = min(model.numel_layer, slot_numel(model, plan)[0])  # with expert groups: one part's
    grads = layer_n * c
    tile = None if grouped(model, plan) else plan.mlp_tile_tokens
    attention_tile = plan.attention_tile_tokens
    untiled = (tile is None or tile >= work.seq_len) and (attention_tile is None or attention_tile >= work.seq_len)
    if model.experts.num_experts and untiled:
        return sparse_working_set.layer_working_set(model, work, plan, layer_n)
    d = work.compute_dtype
    w, m = (sparse_working_set.bytes_per_token(model, d) if model.experts.num_experts else
            (model.layer_working_bytes_per_token(d), model.mlp_working_bytes_per_token(d)))
    u = mbs * tile if tile is not None and tile < work.seq_len else t
    if attention_tile is not None and attention_tile < work.seq_len:
        A = model.attention_whole_bytes_per_token(work.compute_dtype)
        a = model.attention_tile_bytes_per_token(work.compute_dtype)
        v = mbs * attention_tile
        return (t * A + u * m + v * a + grads,
                f"t x A + u x m + v x a + layer x c = {t} x {A} + {u} x {m} + {v} x {a} + {layer_n} x {c}")
    if tile is None or tile >= work.seq_len:
        return t * w + grads, f"t x w + layer x c = {t} x {w} + {layer_n} x {c}"
    h = model.hidden_size
    return (t * (w - m) + u * m + t * h * c + grads,
            f"t x (w - m) + u x m + t x h x c + layer x c = {t} x ({w} - {m}) + {u} x {m} + {t} x {h} x {c} "
            f"+ {layer_n} x {c}")


def listed_host_bytes(est: MemoryEstimate, device_is_host: bool) -> int:
    """Bytes of the buffers the runtime allocates that live in host RAM (device ones too when the device
    is the CPU), without the fixed terms: what peak RSS growth is compared with."""
    return sum(x.nbytes for x in est.components
               if (x.where == "host" or (device_is_host and x.where == "device")) and x.name not in FIXED_TERMS)


# The device buffers that grow with the batch's tokens (the weight slots, gradient buffers and host arenas are
# allocated with the engine, before its first step).
ACTIVATION_TERMS = ("activation checkpoints", "checkpoint staging", "checkpoint drains in flight", "activation grad",
                    "layer working set", "attention working set", "logits chunk", "kept activations")


def activation_bytes(model: ModelShape, work: Workload, plan: Plan) -> int:
    """The plan's device buffers of ``ACTIVATION_TERMS``: what ``Engine(config)`` without a plan weighs against
    the memory free at its first step (kept_layers.default_kept_layers)."""
    return sum(x.nbytes for x in estimate(model, work, plan).components
               if x.where == "device" and x.name in ACTIVATION_TERMS)


# Components that are not buffers of the runtime: constants or fitted from runs.
FIXED_TERMS = ("process", "temporaries", "allocator retention", "CUDA context", "allocator slack")

def spilled_kinds(plan: Plan, model: ModelShape | None = None) -> tuple[BufferKind, ...]:
    """The fp32 kinds of which a plan keeps at least one block in spill files: the rule the runtime's host store
    follows (``buffer_kinds.placement``). A shorthand plan ("none", "optimizer", "all") needs no model."""
    if model is not None:
        return spill_placement.Spilled.of(model, plan).kinds
    assert plan.spill != "blocks", "a per-block placement needs the model"
    return buffer_kinds.spilled_kinds(buffer_kinds.placement(plan, 1))
