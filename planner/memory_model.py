"""Memory model: every buffer the runtime allocates for a Plan, component by component, then summed.

Never a max-of-stages shortcut: each component below is a buffer the runtime
holds for the whole step (or a transient that peaks inside one block), and the
totals are plain sums. Symbols used in the formulas:

  N   elements of all distinct blocks' flat buffers (params, each offset aligned to 64 elements)
  Bmax elements of the largest block (one slot); E the embedding block's elements
  L   decoder layers; h hidden size; V vocab size; k the layers the plan keeps (``Plan.kept_layers``), whose
      activations stay for backward instead of a checkpoint (kept_layers.py: a bytes per token)
  T   global batch tokens per step (batch x seq); t micro-batch tokens (micro_batch_size x seq)
  c   compute dtype bytes (2 for bf16/fp16, 4 for fp32)
  K   plan.num_slots; G plan.device_grad_buffers; S plan.host_grad_slabs
  P   plan.spill_staging; Ck elements of one spill chunk: min(plan.spill_chunk_bytes, Bmax rounded up to
      4 KiB) / 4 (buffer_kinds.spill_chunk_numel); k the number of kinds with a block on disk
  Ns_k elements of kind k whose blocks the plan spills (spill_placement.Spilled: every block for a
      shorthand's kinds); F_k its spill file: sum over those blocks of (block x 4 rounded up to 4 KiB)

Pure stdlib.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import buffer_kinds, kept_layers, spill_placement
from .buffer_kinds import BufferKind, crosses_pcie, spill_chunk_numel
from .hardware import GiB, HardwareProfile
from .model_shapes import ModelShape
from .plan import Plan
from .workload import Workload

# The CUDA context, cuBLAS workspaces and kernels' own memory: a constant until fitted from runs.
CUDA_CONTEXT_BYTES = 1 * GiB
# Caching-allocator fragmentation on the device: a fraction of the device tensors, fitted later.
ALLOCATOR_SLACK_FRACTION = 0.05
# The host process itself: Python, torch libraries, the data loader (not pinned), fitted later. With a GPU,
# the CUDA libraries and the context's host side are most of it.
HOST_PROCESS_BYTES = 2 * GiB
# The same without a GPU: Python and torch's CPU libraries only. Resident bytes of a process that imported
# torch and megatrain, before the engine: 0.22 GiB measured (benchmarks/spill_scale.py's rss_before_engine, torch
# 2.13 CPU build); the step's transients are the device terms (the device is the host).
HOST_PROCESS_BYTES_CPU = 256 * 2**20

WHERE = ("device", "host", "nvme")


@dataclass(frozen=True)
class Component:
    """One buffer (or group of equal buffers) the runtime allocates."""

    name: str
    where: str          # "device", "host" or "nvme"
    nbytes: int
    formula: str        # how nbytes was computed, for tables and review
    pinned: bool = False

    def __post_init__(self) -> None:
        assert self.where in WHERE, self.where
        assert self.nbytes >= 0, (self.name, self.nbytes)


@dataclass(frozen=True)
class Overrun:
    """A budget a plan exceeds: which one, what it needs, what there is."""

    budget: str         # "gpu memory", "host RAM", "NVMe"
    needed: int
    available: int

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
        return sum(c.nbytes for c in self.components if c.where == where)

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

    def overruns(self, hw: HardwareProfile) -> list[Overrun]:
        """Budgets this estimate exceeds on ``hw``. Without a GPU, device buffers live in host RAM."""
        out = []
        if hw.device_is_host:
            needed = self.device_bytes + self.host_bytes
            if needed > hw.host_budget_bytes:
                out.append(Overrun("host RAM", needed, hw.host_budget_bytes))
            return out
        if self.device_bytes > hw.gpu_mem_bytes:
            out.append(Overrun("gpu memory", self.device_bytes, hw.gpu_mem_bytes))
        if self.host_bytes > hw.host_budget_bytes:
            out.append(Overrun("host RAM", self.host_bytes, hw.host_budget_bytes))
        return out

    def rows(self) -> list[dict[str, object]]:
        return [{"name": c.name, "where": c.where, "bytes": c.nbytes, "pinned": c.pinned, "formula": c.formula}
                for c in self.components]


def estimate(model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile | None = None) -> MemoryEstimate:
    """Every buffer of ``plan`` for ``model`` and ``work``. ``hw`` decides whether the device is a GPU
    (CUDA context, allocator slack, pinned host arenas) or the CPU itself, and, where it carries a
    calibration for the compute dtype, the fixed terms (process baseline, temporaries) are its fitted ones."""
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
    dev("weight slots", K * Bmax * c, f"K x Bmax x c = {K} x {Bmax} x {c}")
    dev("grad accumulators", G * Bmax * 4, f"G x Bmax x 4 = {G} x {Bmax} x 4")
    if model.tie_word_embeddings:
        # The head's gradient of the shared weight waits here until the embedding's backward.
        dev("tied embedding grad", E * 4, f"E x 4 = {E} x 4")
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
    dev("logits chunk", chunk * V * (c + 4 + 4), f"chunk x V x (c + 4 + 4) = {chunk} x {V} x {c + 8}")
    if on_gpu:
        tensors = sum(x.nbytes for x in comps if x.where == "device")
        dev("allocator slack", tensors * ALLOCATOR_SLACK_FRACTION,
            f"{ALLOCATOR_SLACK_FRACTION} x device tensors = {ALLOCATOR_SLACK_FRACTION} x {tensors}")
        dev("CUDA context", CUDA_CONTEXT_BYTES, "constant, fitted from runs")

    # ---- host (and spill files) --------------------------------------------------------------
    spilled = spill_placement.Spilled.of(model, plan)
    for kind, label, s in ((BufferKind.MASTER, "fp32 master", 4), (BufferKind.EXP_AVG, "Adam m", work.state_bytes),
                           (BufferKind.EXP_AVG_SQ, "Adam v", work.state_bytes)):
        state_terms(kind, label, N, spilled, host, comps, size=s, pinned=crosses_pcie(kind, c == 4))
    host_spill_terms(model, plan, c, spilled, host, comps)
    if plan.checkpoints == "host":
        host("activation checkpoints", R * T * h * c, f"(L - k) x T x h x c = {R} x {T} x {h} x {c}")
    cal = hw.fitted(work.compute_dtype) if hw is not None else None
    if cal is None:
        if on_gpu:
            host("process", HOST_PROCESS_BYTES, "constant: Python, torch, CUDA libraries, data loader", pinned=False)
        else:
            host("process", HOST_PROCESS_BYTES_CPU, "constant: Python, torch's CPU libraries (no GPU)", pinned=False)
    else:
        host("process", cal.process_bytes, "fitted: resident bytes before the engine (megatrain-plan calibrate)",
             pinned=False)
        # What autograd, the allocator and the loss keep beyond the listed buffers at the step's peak:
        # a + b x (layer working set + logits chunk), fitted from peak RSS growth.
        transient = transient_bytes(model, work, plan)
        host("temporaries", cal.temporaries(transient),
             f"fitted: a + b x (working set + logits chunk) = {cal.temporaries_bytes} + "
             f"{cal.temporaries_factor:.3f} x {transient}", pinned=False)
    if not spilled.kinds:
        comps.append(Component("spill files", "nvme", 0, "0: nothing spills in this plan"))
    return MemoryEstimate(tuple(comps))


def state_terms(kind: BufferKind, label: str, N: int, spilled: "spill_placement.Spilled", host,
                comps: list[Component], file_label: str | None = None, size: int = 4, pinned: bool = True) -> None:
    """One kind's RAM arena and spill file: s x (N - Ns_k) bytes of RAM for the blocks in RAM (none when every
    block spills; s: 4, or 2 for bf16 AdamW state, which never spills) and F_k bytes on disk for the others.
    ``pinned``: whether the arena crosses PCIe (``buffer_kinds.crosses_pcie``), pinned with a GPU."""
    Ns, F = spilled.numel(kind), spilled.file_bytes(kind)
    if Ns < N:
        host(label, size * (N - Ns),
             f"{size} x N = {size} x {N}" if not Ns else f"{size} x (N - Ns) = {size} x ({N} - {Ns})", pinned)
    if Ns:
        comps.append(Component(file_label or f"{label} (spill file)", "nvme", F,
                               f"sum over its spilled blocks of 4 KiB-rounded block x 4 = {F}"))


def host_spill_terms(model: ModelShape, plan: Plan, c: int, spilled: "spill_placement.Spilled",
                     host, comps: list[Component]) -> None:
    """The shadow, the gradients and the spill buffers in host RAM (and the grads spill file). Every spill
    buffer is bounded by one chunk (Ck), never by the largest block: spilling needs less RAM than not."""
    N, Bmax = model.numel_total, model.numel_largest_block
    if c != 4:  # in fp32 the master is the weights that travel; with the master spilled, read from its file
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
        k = len(spilled.kinds)
        P = plan.spill_staging
        host("spill staging", P * k * Ck * 4, f"P x k x Ck x 4 = {P} x {k} x {Ck} x 4",
             pinned=False)


def transient_bytes(model: ModelShape, work: Workload, plan: Plan) -> int:
    """The step's transient device working set, what fitted temporaries scale with:
    layer working set + logits chunk (``layer_working_set`` + chunk x V x (c + 8))."""
    c = work.compute_bytes
    t = min(plan.micro_batch_size, work.batch) * work.seq_len
    chunk = min(plan.loss_chunk_tokens, t)
    return layer_working_set(model, work, plan)[0] + chunk * model.vocab_size * (c + 4 + 4)


def layer_working_set(model: ModelShape, work: Workload, plan: Plan) -> tuple[int, str]:
    """One layer's peak (backward after recompute) for one micro-batch, and its formula.

    Untiled: t x w + layer x c (w: ``layer_working_bytes_per_token``; autograd's per-parameter grads of
    one layer in compute dtype before they are added into fp32). With ``mlp_tile_tokens`` below the
    sequence, the MLP's share m (``mlp_working_bytes_per_token``) is held for one tile of
    u = micro-batch x tile tokens only, plus dh (t x h x c), the layer-input gradient the tiles fill:
    t x (w - m) + u x m + t x h x c + layer x c. With ``attention_tile_tokens`` below the sequence too, the
    attention half holds whole only q, k, v, its output and their gradients, h and dh
    (A = ``attention_whole_bytes_per_token``), and its token-local work for one tile of v tokens
    (a = ``attention_tile_bytes_per_token``): t x A + u x m + v x a + layer x c (u = t when the MLP is
    untiled)."""
    c = work.compute_bytes
    mbs = min(plan.micro_batch_size, work.batch)
    t = mbs * work.seq_len
    w = model.layer_working_bytes_per_token(work.compute_dtype)
    grads = model.numel_layer * c
    tile, attention_tile = plan.mlp_tile_tokens, plan.attention_tile_tokens
    m = model.mlp_working_bytes_per_token(work.compute_dtype)
    u = mbs * tile if tile is not None and tile < work.seq_len else t
    if attention_tile is not None and attention_tile < work.seq_len:
        A = model.attention_whole_bytes_per_token(work.compute_dtype)
        a = model.attention_tile_bytes_per_token(work.compute_dtype)
        v = mbs * attention_tile
        return (t * A + u * m + v * a + grads,
                f"t x A + u x m + v x a + layer x c = {t} x {A} + {u} x {m} + {v} x {a} + {model.numel_layer} x {c}")
    if tile is None or tile >= work.seq_len:
        return t * w + grads, f"t x w + layer x c = {t} x {w} + {model.numel_layer} x {c}"
    h = model.hidden_size
    return (t * (w - m) + u * m + t * h * c + grads,
            f"t x (w - m) + u x m + t x h x c + layer x c = {t} x ({w} - {m}) + {u} x {m} + {t} x {h} x {c} "
            f"+ {model.numel_layer} x {c}")


# The most elements one tensor of one attention call may have (models/layers/attention.py's MAX_ELEMENTS, a flash
# kernel's 32-bit indexing): the heads are split into groups under it.
ATTENTION_MAX_ELEMENTS = 2**31 - 1


def attention_head_groups(rows: int, seq: int, head_dim: int, n_heads: int, n_kv_heads: int,
                          max_elements: int = ATTENTION_MAX_ELEMENTS) -> tuple[int, int, int]:
    """(query heads, kv heads, calls) of the runtime's attention split ([Note: head groups] in attention.py):
    with n_rep = n_heads / n_kv_heads and one head of rows x seq x head_dim elements, the most kv heads g (a
    divisor of n_kv_heads) with g x n_rep x head <= max_elements, each with its n_rep query heads; else one kv
    head with the most query heads r (a divisor of n_rep) with r x head <= max_elements. (One head over the
    limit is refused by the runtime; counted here as one head per call.)"""
    n_rep = n_heads // n_kv_heads
    head = rows * seq * head_dim
    fits = [g for g in range(1, n_kv_heads + 1) if n_kv_heads % g == 0 and g * n_rep * head <= max_elements]
    if fits:
        g = max(fits)
        return g * n_rep, g, n_kv_heads // g
    r = max([r for r in range(1, n_rep + 1) if n_rep % r == 0 and r * head <= max_elements] or [1])
    return r, 1, n_kv_heads * (n_rep // r)


def attention_working_set(model: ModelShape, work: Workload, plan: Plan,
                          grads_counted: bool = False) -> tuple[int, str]:
    """What one attention call's backward adds to the layer working set, for one micro-batch, counted for one
    head group (the calls run one after another; ``attention_head_groups``), and its formula.

    The layer working set already holds q, k, v and the attention output (O(t), flash: no S x S scores).
    Per group of gq query heads and gk kv heads, the backward adds: dq, dk, dv of the group (t x D x (gq + 2 gk)
    x c) and in bf16 / fp16 flash's fp32 dQ accumulator (t x D x gq x a, a = 4 where c < 4, else 0), unless
    ``grads_counted`` (a layer working set that already holds them for every head); and always, when the
    group shares kv heads (gq > gk), dk and dv expanded to its query heads before they are summed
    (t x D x 2 gq x c), and with more than one call the output twice (the groups' outputs, saved for their
    backward, and their concatenation: t x q x c):
      t x D x ([gq x (c + a) + 2 gk x c] [+ 2 gq x c if gq > gk]) [+ t x q x c if calls > 1]
    On a CPU (fp32, torch's flash kernel for CPU) peak memory grows linearly in t: no S x S scores
    (one attention forward + backward, 4 heads / 2 kv heads / D 64: 119, 199, 360 MiB at 16k, 32k, 64k tokens;
    with two calls 426 MiB at 64k: one more output)."""
    c = work.compute_bytes
    a = 4 if c < 4 else 0
    rows = min(plan.micro_batch_size, work.batch)
    t, D, q = rows * work.seq_len, model.head_dim, model.num_heads * model.head_dim
    gq, gk, calls = attention_head_groups(rows, work.seq_len, D, model.num_heads, model.num_kv_heads)
    grads = 0 if grads_counted else gq * (c + a) + 2 * gk * c
    shared = 2 * gq * c if gq > gk else 0
    both = t * q * c if calls > 1 else 0
    terms = ([] if grads_counted else [("gq x (c + a) + 2 gk x c", f"{gq} x {c + a} + 2 x {gk} x {c}")]) + (
        [("2 gq x c", f"2 x {gq} x {c}")] if shared else [])
    formula = (f"t x D x ({' + '.join(n for n, _ in terms) or '0'}){' + t x q x c' if both else ''} = {t} x {D} x "
               f"({' + '.join(v for _, v in terms) or '0'}){f' + {t} x {q} x {c}' if both else ''} "
               f"({calls} call{'s' if calls > 1 else ''} of {gq} query heads)")
    return t * D * (grads + shared) + both, formula


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
FIXED_TERMS = ("process", "temporaries", "CUDA context", "allocator slack")

def spilled_kinds(plan: Plan, model: ModelShape | None = None) -> tuple[BufferKind, ...]:
    """The fp32 kinds of which a plan keeps at least one block in spill files: the rule the runtime's host store
    follows (``buffer_kinds.placement``). A shorthand plan ("none", "optimizer", "all") needs no model."""
    if model is not None:
        return spill_placement.Spilled.of(model, plan).kinds
    assert plan.spill != "blocks", "a per-block placement needs the model"
    return buffer_kinds.spilled_kinds(buffer_kinds.placement(plan, 1))
