"""Cost model: the time of one training step for a Plan, and which resource bounds each phase.

The runtime runs three streams (H2D copies, compute, D2H copies) plus CPU AdamW
workers. A step is one pass over the block sequence

    forward:  embedding, layer 0 .. layer L-1, head (the head's loss and its backward run here)
    backward: layer L-1 .. layer 0, embedding (no weights needed: a scatter-add of dy)

and each block is a (load, compute, drain) triple on those streams. Rather than
add per-block maxima, the model replays the pipeline as a small event simulation
with the plan's bounds (slots, prefetch depth, grad buffers, checkpoint staging),
which is the design's per-block max(compute, H2D, D2H) in steady state and also
gets the pipeline's fill, drain and uneven blocks right (a 1 GB embedding next to
small layers). Every term's formula is written beside its code.

Pure stdlib.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatrain.planner.costs import (kept_layers, resident_blocks, spill_placement, spill_timing, step_replay,
                                     step_traffic)
from megatrain.plan.buffer_kinds import BufferKind, load_bytes
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan
from megatrain.planner.costs.adam_time import AdamTime
from megatrain.planner.costs.step_replay import BlockVisit
from megatrain.planner.shapes.workload import StepBatch, Workload

# Fixed cost of one copy on a stream (launch + DMA setup), seconds.
COPY_LATENCY_S = 10e-6
# Kernel launches per block per micro-batch: forward ~30 kernels, recompute + backward ~80, ~8 us each.
LAUNCH_FWD_S = 0.25e-3
LAUNCH_BWD_S = 0.65e-3
# Matmul efficiency against the profile's peak falls for small micro-batches:
# eff(t) = t / (t + T_HALF) with t tokens per micro-batch (fitted later).
T_HALF_TOKENS = 128
# Uncalibrated, the layers run at peak / factor. CPU: elementwise work (norms, RoPE, SiLU) on the matmuls. GPU: the
# two H200 runs' compute at -8% / +9% (1B / 8B shapes, benchmarks/results/2026-11-26_H200_step_anatomy_*).
NONMATMUL_FACTOR = {"cpu": 1.10, "gpu": 1.78}


@dataclass(frozen=True)
class PhaseTime:
    """One phase of the step: its wall time and how busy each resource was in it."""

    seconds: float
    compute_s: float
    h2d_s: float
    d2h_s: float
    adam_s: float

    @property
    def bottleneck(self) -> str:
        busy = {"compute": self.compute_s, "H2D": self.h2d_s, "D2H": self.d2h_s, "CPU AdamW": self.adam_s}
        name = max(busy, key=lambda k: busy[k])  # no resource busy most of the phase: waits between them dominate
        return name if busy[name] >= 0.7 * self.seconds else f"pipeline stalls ({name} busiest)"


@dataclass(frozen=True)
class CostEstimate:
    step_seconds: float
    forward: PhaseTime
    backward: PhaseTime
    # CPU AdamW time the step waits for (eager: what outlasts backward; deferred: what delays forward).
    optimizer_exposed_seconds: float
    tokens: int
    model_flops: float        # 6 x N_matmul x tokens (model_flops.py, DESIGN.md section 7)
    hardware_flops: float     # what the GPU runs: forward + recompute + backward + head, attention included
    attention_flops: float    # attention forward + backward per step, stated separately
    peak_tflops: float
    h2d_bytes: float = 0.0    # what one step copies host -> device (weights, host checkpoints)
    d2h_bytes: float = 0.0    # and device -> host (fp32 grads, host checkpoints)
    disk_read_bytes: float = 0.0   # what one step reads from the spill files (disk_traffic)
    disk_write_bytes: float = 0.0  # and writes to them
    disk_seconds: float = 0.0      # read / read GB/s + write / write GB/s: the disk's share of the roofline
    constants: str = "defaults"  # where the efficiency terms came from (hw.constants)
    recompute_flops: float = 0.0   # the recomputed layers' forwards in backward (inside hardware_flops)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.step_seconds

    @property
    def model_tflops(self) -> float:
        return self.model_flops / self.step_seconds / 1e12

    @property
    def mfu(self) -> float:
        """Model TFLOP/s over the profile's measured matmul peak for the compute dtype."""
        return self.model_tflops / self.peak_tflops

    @property
    def bottleneck(self) -> str:
        slow = self.forward if self.forward.seconds >= self.backward.seconds else self.backward
        return slow.bottleneck

    def to_dict(self) -> dict[str, object]:
        phase = lambda p: {"seconds": p.seconds, "compute_s": p.compute_s, "h2d_s": p.h2d_s,  # noqa: E731
                           "d2h_s": p.d2h_s, "adam_s": p.adam_s, "bottleneck": p.bottleneck}
        return {"step_seconds": self.step_seconds, "tokens_per_second": self.tokens_per_second,
                "model_tflops": self.model_tflops, "mfu": self.mfu, "forward": phase(self.forward),
                "backward": phase(self.backward), "optimizer_exposed_seconds": self.optimizer_exposed_seconds,
                "attention_tflops": self.attention_flops / self.step_seconds / 1e12,
                "hardware_tflops": self.hardware_flops / self.step_seconds / 1e12, "bottleneck": self.bottleneck,
                "h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes, "disk_read_bytes": self.disk_read_bytes,
                "disk_write_bytes": self.disk_write_bytes, "disk_seconds": self.disk_seconds,
                "recompute_flops": self.recompute_flops, "constants": self.constants}


def _copy_s(nbytes: float, gbps: float) -> float:
    """t = bytes / bandwidth + latency (0 when nothing moves)."""
    return nbytes / (gbps * 1e9) + COPY_LATENCY_S if nbytes > 0 else 0.0


# [Note: priced steps]
# The search prices each fitted candidate's variants, many of which differ only in what a step's time never reads:
# how the runtime tiles its work and pieces its checkpoint copies, its I/O settings, the expert groups (the memory
# model's), and, with a GPU, the spill staging sets and chunks (only a CPU step's disk, spill_timing, reads those).
# ``estimate`` keeps its answers by everything else (up to ESTIMATES_KEPT; the model and hardware by identity, each
# kept alive beside its answer), so such a variant costs a lookup: on Qwen2.5-32B on an H200 723 prices a search
# become 243. tests/test_priced_steps.py checks that a step's time reads none of these fields.
UNTIMED_FIELDS = frozenset({"mlp_tile_tokens", "attention_tile_tokens", "checkpoint_piece_tokens", "expert_group_size",
                            "spill_dir", "io_backend", "io_threads", "io_direct", "io_direct_reads", "workload"})
UNTIMED_WITH_GPU = UNTIMED_FIELDS | {"spill_staging", "spill_chunk_bytes"}
ESTIMATES_KEPT = 4096
# the names of the Plan fields a step's time reads, without a GPU and with one (a new field counts until listed)
_TIMED = {host: tuple(f.name for f in dataclasses.fields(Plan) if f.name not in (UNTIMED_FIELDS if host else
                                                                                 UNTIMED_WITH_GPU))
          for host in (True, False)}
_ESTIMATES: dict[tuple, tuple[ModelShape, HardwareProfile, "CostEstimate"]] = {}


def estimate(model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile, world: int = 1) -> CostEstimate:
    """``price``'s estimate, kept for the plans that differ only in fields it does not read ([Note: priced steps])."""
    key = (id(model), id(hw), work, world, tuple([getattr(plan, name) for name in _TIMED[hw.device_is_host]]))
    found = _ESTIMATES.get(key)
    if found is not None and found[0] is model and found[1] is hw:
        return found[2]
    cost = price(model, work, plan, hw, world)
    if len(_ESTIMATES) >= ESTIMATES_KEPT:
        _ESTIMATES.clear()
    _ESTIMATES[key] = (model, hw, cost)
    return cost


def price(model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile, world: int = 1) -> CostEstimate:
    """The step's time, phase by phase: rates, the block visits of forward and backward, AdamW, the replay.
    ``world``: one of that many data-parallel ranks (a resident block's device update covers its shard)."""
    batch = StepBatch.of(work, plan)
    adam = AdamTime(model, work, plan, hw)
    on_cpu = spill_timing.applies(hw, plan, adam.spilled)  # a spilled step without a GPU: spill_timing
    rates = _Rates.of(model, work, batch, hw, plan.compiled_layers)
    rates = rates if on_cpu else _with_disk_loads(rates, model, work, plan, hw)
    slabs = step_replay.HostSlabs(plan)
    steps = _forward_steps(model, work, plan, batch, rates, adam, slabs)
    n_fwd = len(steps)
    steps += _backward_steps(model, work, plan, batch, rates, adam, slabs)
    resident_blocks.add_device_updates(model, plan, steps, n_fwd, hw, world, work.clipping)
    if plan.optimizer_mode != "eager" and not hw.device_is_host:
        _gate_loads_on_deferred_adam(model, steps, adam)
    total_adam = adam.arithmetic() if on_cpu else adam.total()  # on_cpu: its disk time is spill_timing's
    if on_cpu:
        cpu = spill_timing.cpu_step(adam.spilled, plan, hw, steps, n_fwd, total_adam, model.tie_word_embeddings,
                                    work.compute_bytes)
        fwd_end, step, exposed = cpu.forward_s, cpu.step_s, total_adam + cpu.update_exposed_s
    else:
        fwd_end, step, exposed = step_replay.step_time(steps, n_fwd, plan, hw, total_adam)
    eager = plan.optimizer_mode == "eager"
    fwd = PhaseTime(fwd_end, *step_replay.busy(steps[:n_fwd]),
                    adam_s=(0.0 if eager or hw.device_is_host else total_adam))
    bwd = PhaseTime(step - fwd_end, *step_replay.busy(steps[n_fwd:]),
                    adam_s=(total_adam if eager or hw.device_is_host else 0.0))
    T, seq = batch.tokens, batch.seq
    attn = T * model.attention_model_flops_per_token(seq)
    h2d_bytes, d2h_bytes = step_traffic.traffic(model, work, plan)
    # less the masters loads take from their update's writes ([Note: spilled loads]) or copy from the staging sets
    disk_read, disk_write = step_traffic.disk_traffic(model, work, plan, tapped=spill_timing.tapped(hw, plan))
    disk_read -= cpu.lent_bytes if on_cpu else 0.0  # ([Note: lent masters])
    disk_s = (disk_read / (hw.disk_read_gbps * 1e9) + disk_write / (hw.disk_write_gbps * 1e9)) if disk_read else 0.0
    step = max(step, disk_s)  # the disk is a resource of the step like the others: never faster than it
    # recompute = (L - k) x T x layer_flops_recompute(seq); hardware FLOPs count every layer's recompute, less the
    # kept layers' k x T x layer_flops_recompute(seq)
    per_layer = T * model.layer_flops_recompute(seq)
    recompute = kept_layers.recomputed_layers(model, plan) * per_layer
    hardware = model.hardware_flops_per_token(seq) * T - (model.num_layers * per_layer - recompute)
    return CostEstimate(step_seconds=step, forward=fwd, backward=bwd, optimizer_exposed_seconds=exposed,
                        tokens=T, model_flops=model.model_flops_per_token() * T, recompute_flops=recompute,
                        hardware_flops=hardware, attention_flops=attn,
                        peak_tflops=rates.peak_tflops, h2d_bytes=h2d_bytes, d2h_bytes=d2h_bytes,
                        disk_read_bytes=disk_read, disk_write_bytes=disk_write, disk_seconds=disk_s,
                        constants=hw.constants(work.compute_dtype))


@dataclass(frozen=True)
class _Rates:
    """What work costs on this machine: compute FLOP/s, launches per block visit, copy bandwidths."""

    flops_per_s: float         # the decoder layers' achieved rate at this width and micro-batch
    attention_flops_per_s: float  # their causal attention's, measured by sequence length (0: at flops_per_s)
    head_flops_per_s: float    # the head's, when fitted apart (0: the layers' rate plus launches)
    launch_fwd_s: float        # per block per micro-batch, forward
    launch_bwd_s: float        # per block per micro-batch, recompute + backward
    h2d_gbps: float
    d2h_gbps: float
    duplex_scale: float        # each direction's share of the link when both run
    peak_tflops: float
    sparse_factor: float       # the routed experts' seconds over their FLOPs at flops_per_s (fitted; else 1)
    compiled_speedup: float = 1.0  # Plan.compiled_layers: the profile's eager / compiled layer time (else 1)

    @classmethod
    def of(cls, model: ModelShape, work: Workload, batch: StepBatch, hw: HardwareProfile,
           compiled: bool = False) -> "_Rates":
        h, t = model.hidden_size, batch.micro_tokens
        peak = hw.tflops(work.compute_dtype)
        cal = hw.fitted(work.compute_dtype)
        if cal is not None:
            # Fitted: rate = r(h) x eff(t), the layers' achieved TFLOP/s at this width and micro-batch (elementwise
            # work and small-shape efficiency included); launches = o split between forward and backward visits
            # as the defaults are; copies at the rates measured inside the step.
            rate = cal.rate_tflops(h, t) * 1e12            # r(h) x t / (t + t_half)
            launch_fwd = cal.block_overhead_s * LAUNCH_FWD_S / (LAUNCH_FWD_S + LAUNCH_BWD_S)
            launch_bwd = cal.block_overhead_s * LAUNCH_BWD_S / (LAUNCH_FWD_S + LAUNCH_BWD_S)
            h2d_gbps, d2h_gbps = cal.h2d_gbps, cal.d2h_gbps
            head_rate = cal.head_tflops(h) * 1e12 if cal.head_tflops_by_width else 0.0
        else:
            rate = peak * 1e12 * t / (t + T_HALF_TOKENS) / NONMATMUL_FACTOR["cpu" if hw.device_is_host else "gpu"]
            launch_fwd, launch_bwd = LAUNCH_FWD_S, LAUNCH_BWD_S
            h2d_gbps, d2h_gbps = hw.h2d_gbps, hw.d2h_gbps
            head_rate = 0.0
        # Without a GPU the copies are memcpys on the host, one after another; with one, H2D and D2H at once
        # share the link: each direction runs at scale x its own rate, scale = min(1, duplex / (h2d + d2h)).
        # Rates fitted in the step already hold that sharing: scale = 1.
        duplex = 1.0 if hw.device_is_host or cal is not None else min(1.0, hw.duplex_gbps / (h2d_gbps + d2h_gbps))
        # Causal attention at the profile's measured rate for this sequence length, apart from the layers' other
        # FLOPs; a calibration that fitted r(h) with attention inside keeps it there.
        attention = hw.attention_rate_tflops(work.compute_dtype, batch.seq)
        attention_rate = attention * 1e12 if attention and (cal is None or cal.attention_apart) else 0.0
        sparse = cal.sparse_factor if cal is not None else 1.0
        speedup = (hw.compiled_speedup(work.compute_dtype) or 1.0) if compiled else 1.0
        return cls(rate, attention_rate, head_rate, launch_fwd, launch_bwd, h2d_gbps, d2h_gbps, duplex, peak, sparse,
                   speedup)

    def layer_seconds(self, flops: float, attention: float, experts: float = 0.0) -> float:
        """A layer visit's FLOP time: (flops - attention - experts) / (layer rate x c) + attention / attention rate +
        s x experts / layer rate, with ``attention`` and ``experts`` (the routed experts' matmuls) inside ``flops``,
        s the fitted sparse factor; the attention at the layer rate (and sped up by c too) when no attention rate
        applies. c: ``compiled_speedup``, the whole layer's eager / compiled time as the profile measured it
        (attention inside, which compiling leaves alone: the rest's own speedup is at least c)."""
        rest, sparse = flops - experts, self.sparse_factor * experts / self.flops_per_s
        if not self.attention_flops_per_s:
            return rest / (self.flops_per_s * self.compiled_speedup) + sparse
        return ((rest - attention) / (self.flops_per_s * self.compiled_speedup) + attention / self.attention_flops_per_s
                + sparse)


def _forward_steps(model: ModelShape, work: Workload, plan: Plan, batch: StepBatch, rates: _Rates, adam: AdamTime,
                   slabs: step_replay.HostSlabs) -> list[BlockVisit]:
    """Embedding, the layers, and the head (whose loss and backward run in the forward pass)."""
    c, M, T = work.compute_bytes, batch.micro_batches, batch.tokens
    host_ckpt = plan.checkpoints == "host"
    ckpt_bytes = T * model.hidden_size * c                   # one block boundary: T x h x c
    E, Lw, H = model.numel_embedding, model.numel_layer, model.numel_head
    scale = rates.duplex_scale if host_ckpt else 1.0
    h2d, d2h = rates.h2d_gbps * scale, rates.d2h_gbps * scale
    # weights and grads copied (w 1; wc bytes a weight: c, or 4 cast on the device), or used in place (0)
    w, wc = (0, 0) if plan.compute_in_place else (1, load_bytes(c, plan.weights_cast))
    wb, wcb = resident_blocks.crossing(plan, w, wc)  # per block: none for a resident one
    steps = [BlockVisit(_copy_s(wcb(0) * E, h2d), M * rates.launch_fwd_s, 0.0)]  # the embedding: a gather
    kept, resident = frozenset(plan.kept_layers), frozenset(plan.resident_blocks)
    # compute_fwd(M) = T x flops_fwd(seq) / rate (attention at its own rate) + M x launch: every layer alike
    comp = (rates.layer_seconds(T * model.layer_flops_fwd(batch.seq), T * model.attention_flops_fwd(batch.seq),
                                T * model.expert_flops_fwd()) + M * rates.launch_fwd_s)
    # load = layer x wc, none for a resident layer; every other layer alike, so each term is priced once
    load = _copy_s(wc * Lw, h2d)
    # host checkpoints: D2H of the block's input (T x h x c), read in place; the layer's compute waits for
    # the previous layer's drain (the runtime lets each micro-batch's drained input go before it saves the
    # next layer's: [Note: host checkpoints in pieces]).
    ckpt_drain = _copy_s(ckpt_bytes, d2h) if host_ckpt else 0.0
    for layer in range(model.num_layers):
        drain = 0.0 if layer in kept else ckpt_drain  # a kept layer drains no checkpoint ([Note: kept layers])
        wait = layer if drain and layer >= 1 else None  # the previous layer's visit, steps[layer]
        # (load, compute, drain, d2h_at_start, wait_d2h_of): positional, a third cheaper than by keyword
        steps.append(BlockVisit(0.0 if 1 + layer in resident else load, comp, drain, True, wait))
    # Head: load (norm [+ lm_head]) x wc, plus the embedding again when tied; compute its forward and
    # backward: T x (2 + 4) x V x h / rate + M x chunks x launch; untied head drains its fp32 grads.
    head_load = H * wcb(model.num_layers + 1) + (E * wcb(0) if model.tie_word_embeddings else 0)
    head_flops = T * (model.head_flops_fwd() + model.head_flops_bwd())
    head_comp = head_flops / rates.flops_per_s + M * batch.loss_chunks * rates.launch_bwd_s
    if rates.head_flops_per_s:
        # Fitted head class, timed alone with its chunk loop: T x (2 + 4) x V x h / r_head(h)
        head_comp = head_flops / rates.head_flops_per_s
    head_untied = not model.tie_word_embeddings
    head_d2h = _copy_s(wb(model.num_layers + 1) * H * 4, d2h) if head_untied else 0.0
    steps.append(BlockVisit(_copy_s(head_load, h2d), head_comp, head_d2h,
                       adam_s=adam.block(model.num_layers + 1) if slabs.eager and head_untied else 0.0,
                       wait_adam_of=slabs.take(len(steps)) if head_untied else None))
    return steps


def _backward_steps(model: ModelShape, work: Workload, plan: Plan, batch: StepBatch, rates: _Rates, adam: AdamTime,
                    slabs: step_replay.HostSlabs) -> list[BlockVisit]:
    """The layers in reverse, then the embedding; indices continue after the forward's steps."""
    c, G, M, T = work.compute_bytes, plan.device_grad_buffers, batch.micro_batches, batch.tokens
    first = model.num_layers + 2                              # the forward's visits come first
    ckpt_bytes = T * model.hidden_size * c if plan.checkpoints == "host" else 0
    Lw = model.numel_layer
    h2d, d2h = rates.h2d_gbps * rates.duplex_scale, rates.d2h_gbps * rates.duplex_scale
    w, wc = (0, 0) if plan.compute_in_place else (1, load_bytes(c, plan.weights_cast))  # as in _forward_steps
    wb = resident_blocks.crossing(plan, w, wc)[0]
    steps: list[BlockVisit] = []
    # compute = (recompute + bwd) = T x (flops_fwd + flops_bwd)(seq) / rate + M x launch, every layer alike.
    # A kept layer ([Note: kept layers]): no checkpoint, no recompute, and its forward's launches not
    # repeated: T x flops_bwd(seq) / rate + M x (launch_bwd - launch_fwd).
    comp_of = {kept: rates.layer_seconds(
        T * ((0.0 if kept else model.layer_flops_recompute(batch.seq)) + model.layer_flops_bwd(batch.seq)),
        T * ((0.0 if kept else model.attention_flops_fwd(batch.seq)) + model.attention_flops_bwd(batch.seq)),
        T * model.expert_flops_fwd() * (2.0 if kept else 3.0))   # experts: backward 2 x forward, recompute 1 x
        + M * (rates.launch_bwd_s - (rates.launch_fwd_s if kept else 0.0)) for kept in (False, True)}
    # load = layer x wc (+ its checkpoint T x h x c when on the host, none for a kept layer); drain = layer x 4
    # (fp32 grads); no weights or grads cross for a resident layer. Each (resident, kept) case priced once.
    load_of = {(res, kept): _copy_s((0 if res else wc) * Lw + (0 if kept else ckpt_bytes), h2d)
               for res in (False, True) for kept in (False, True)}
    drain_of = {res: _copy_s((0 if res else w) * Lw * 4, d2h) for res in (False, True)}
    kept_set, resident = frozenset(plan.kept_layers), frozenset(plan.resident_blocks)
    for k, layer in enumerate(reversed(range(model.num_layers))):
        kept, res = layer in kept_set, 1 + layer in resident
        index = first + k
        wait = index - G if k >= G else None   # a grad buffer frees when its drain ends, G backward visits back
        # (load, compute, drain, d2h_at_start, wait_d2h_of, earliest_load, adam_s, wait_adam_of, backward):
        # positional, half the cost of by keyword (the search builds thousands of these visits a second)
        steps.append(BlockVisit(load_of[res, kept], comp_of[kept], drain_of[res], False, wait, 0.0,
                                adam.blocks[1 + layer] if slabs.eager else 0.0, slabs.take(index), True))
    # Embedding backward: no weights; scatter-add dy (launches only); drain E x 4.
    wait = first + model.num_layers - G if model.num_layers >= G else None
    # Tied: the head's update (its norm) is queued here too, with the shared weight's.
    adam_e = adam.block(0) + (adam.block(model.num_layers + 1) if model.tie_word_embeddings else 0.0)
    steps.append(BlockVisit(0.0, M * rates.launch_bwd_s, _copy_s(wb(0) * model.numel_embedding * 4, d2h),
                            wait_d2h_of=wait, backward=True, adam_s=adam_e if slabs.eager else 0.0,
                            wait_adam_of=slabs.take(first + len(steps))))
    return steps


def _gate_loads_on_deferred_adam(model: ModelShape, steps: list[BlockVisit], adam: AdamTime) -> None:
    """Deferred mode: AdamW runs in forward order after the previous backward (t = 0 here), one block after
    another; the next forward's load of block i waits for adam_done(i) = sum_{j<=i} adam(j)."""
    done = 0.0
    for i in range(model.num_layers + 2):
        done += adam.blocks[i]
        steps[i].earliest_load = done


def _with_disk_loads(rates: "_Rates", model: ModelShape, work: Workload, plan: Plan,
                     hw: HardwareProfile) -> "_Rates":
    """In fp32 a block whose master spills is loaded from its spill file: with every block's master spilled,
    loads run at min(H2D, disk read) GB/s; with some, at the harmonic mix by bytes:
    1 / rate = (1 - s) / H2D + s / min(H2D, disk read), s the spilled share of the master's elements."""
    spilled = spill_placement.Spilled.of(model, plan)
    Ns = spilled.numel(BufferKind.MASTER)
    if work.compute_bytes != 4 or not Ns or hw.disk_read_gbps <= 0:
        return rates
    share = Ns / model.numel_total
    slow = min(rates.h2d_gbps, hw.disk_read_gbps)
    return dataclasses.replace(rates, h2d_gbps=1.0 / ((1 - share) / rates.h2d_gbps + share / slow))


def overhead_units(model: ModelShape, work: Workload, plan: Plan) -> float:
    """The step's fixed per-block costs counted in decoder-layer visits (forward + recompute + backward
    of one layer for one micro-batch = 1), the unit of a fitted ``block_overhead_s``:
    units = (M (embedding) + L M) x f + (M x chunks (head) + L M + M (embedding backward)) x b - k M f,
    f = LAUNCH_FWD / (LAUNCH_FWD + LAUNCH_BWD), b = 1 - f, k kept layers (no recompute's launches)."""
    batch = StepBatch.of(work, plan)
    M, L, chunks = batch.micro_batches, model.num_layers, batch.loss_chunks
    k = L - kept_layers.recomputed_layers(model, plan)
    f = LAUNCH_FWD_S / (LAUNCH_FWD_S + LAUNCH_BWD_S)
    return (M + L * M) * f + (M * chunks + L * M + M) * (1 - f) - k * M * f


def head_overhead_units(model: ModelShape, work: Workload, plan: Plan) -> float:
    """The head's share of ``overhead_units``: M x chunks x b."""
    batch = StepBatch.of(work, plan)
    return batch.micro_batches * batch.loss_chunks * LAUNCH_BWD_S / (LAUNCH_FWD_S + LAUNCH_BWD_S)


