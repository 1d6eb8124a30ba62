"""The Plan: what the runtime executes, as data.

The planner chooses a Plan; the runtime (``megatrain.runtime``) executes it and
makes no policy decisions of its own. A Plan is frozen, validated on
construction, and round-trips through JSON with a version number so that a plan
written by one release is either read exactly or refused with a clear message.

This module is pure stdlib: the runtime imports it, and it imports nothing of
the runtime.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

from megatrain.plan.plan_checks import (PlanError, at_least, check_compiled, check_host_device, check_resident,
                                        kept_layer_numbers, one_of, resident_block_numbers)
from megatrain.plan.workload_fingerprint import WorkloadFingerprint, fingerprint_from_dict

PLAN_VERSION = 1

CHECKPOINT_PLACEMENTS = ("device", "host")
OPTIMIZER_MODES = ("eager", "deferred")
# Where CPU AdamW runs: a worker thread of its own, or the thread that runs the step ([Note: helper threads]).
ADAM_THREADS = ("worker", "compute")
WEIGHTS_CASTS = ("host", "device")
# "blocks": per kind, the blocks ``Plan.spill_blocks`` names; the others are shorthands for every block of their
# kinds ("optimizer": m and v; "all": master, m, v and grads).
SPILL_CHOICES = ("none", "optimizer", "all", "blocks")
# The fp32 kinds a plan may keep in spill files (buffer_kinds.BufferKind's values), and each shorthand's.
SPILL_KINDS = ("master", "exp_avg", "exp_avg_sq", "grads")
SPILL_SHORTHANDS = {"none": (), "optimizer": ("exp_avg", "exp_avg_sq"), "all": SPILL_KINDS}
IO_BACKENDS = ("auto", "posix", "kvikio")
# spill_chunk_bytes is a multiple of this: the spill files' alignment (buffer_kinds.SPILL_ALIGN).
SPILL_CHUNK_ALIGN = 4096


@dataclass(frozen=True)
class SpillBlocks:
    """Per fp32 kind, the blocks whose state lives in spill files (the rest of that kind stays in RAM).

    Blocks are indexed as the runtime orders them: 0 the embedding, 1..L the decoder layers, L + 1 the head
    (final norm and lm_head). Each field is a sorted tuple of distinct indices (a JSON list on disk).
    """

    master: tuple[int, ...] = ()
    exp_avg: tuple[int, ...] = ()
    exp_avg_sq: tuple[int, ...] = ()
    grads: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for kind in SPILL_KINDS:
            value = getattr(self, kind)
            if not isinstance(value, (list, tuple)) or not all(
                    isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in value):
                raise PlanError(f"spill_blocks.{kind}={value!r} must be a list of block indices >= 0 "
                                "(0 the embedding, 1..L the layers, L + 1 the head)")
            if len(set(value)) != len(value):
                raise PlanError(f"spill_blocks.{kind}={list(value)!r} names a block twice; list each block once")
            object.__setattr__(self, kind, tuple(sorted(value)))

    def blocks(self, kind: str) -> tuple[int, ...]:
        return getattr(self, kind)

    @property
    def empty(self) -> bool:
        return not any(self.blocks(k) for k in SPILL_KINDS)


@dataclass(frozen=True)
class Plan:
    """How one training step moves data. Every bound in the runtime comes from here.

    Memory each field implies (device unless said otherwise):
      num_slots           K x (largest block, compute dtype) weight slots
      device_grad_buffers G x (largest block, fp32) gradient accumulators
      checkpoints         "device": n_layers x tokens x hidden x compute bytes on the GPU;
                          "host": the same in pinned host RAM, plus on the GPU two reload buffers of one
                          micro-batch's input (2 x micro-batch tokens x hidden x compute bytes) and the
                          drained inputs of one layer until their copies end (tokens x hidden x compute bytes)
      checkpoint_piece_tokens  "host": checkpoint copies (drain, reload) of at most this many tokens x hidden x
                          compute bytes each (None: a micro-batch's input in one copy); no memory of its own
      host_grad_slabs     eager mode only: S x (largest block, fp32) host RAM
                          (deferred mode keeps a full fp32 gradient arena instead)
      loss_chunk_tokens   logits chunk: chunk x vocab x (compute + 12) bytes
      mlp_tile_tokens     the MLP's intermediates: micro-batch x min(tile, S) x intermediate x 3 x compute
                          bytes (None: untiled, S tokens); layers streamed in expert groups run their experts
                          untiled whatever it says
      attention_tile_tokens  the attention half's token-local intermediates (norm output, fp32 norm copies,
                          pre-RoPE q and k, o_proj's input) for micro-batch x min(tile, S) tokens instead of S
                          (None: untiled); q, k, v, attention's output and their gradients stay whole
      compute_in_place    a CPU device computing on the host's weights and gradients: no weight slots, gradient
                          accumulators or tied-embedding gradient buffer (0 bytes each)
      weights_cast        "device" (bf16 / fp16): the loads copy the fp32 master (4 x N pinned, no c x N shadow
                          in RAM) and round it on the device through one fp32 block in flight (largest block x 4)
      kept_layers         the decoder layers (0..L-1) whose forward graph stays for backward instead of being
                          recomputed from a boundary checkpoint: each T x (kept bytes per token - h x c) more
                          (memory_model "kept activations"), one layer forward less in backward
      resident_blocks     the blocks (0 the embedding, 1..L the layers, L + 1 the head) whose fp32 master, AdamW m
                          and v and gradient live in device memory, 16 bytes a parameter there (none of it in host
                          RAM), updated on the device by torch's AdamW: their loads cast on the device, their
                          gradients never leave it ([Note: resident blocks] in runtime/state/resident_state.py)
      spill               "optimizer": AdamW m and v live in spill files on disk (8 bytes/param off RAM);
                          "all": the fp32 master and gradients too (16 bytes/param off RAM);
                          "blocks": per kind, the blocks ``spill_blocks`` names (4 bytes/param of each
                          named block and kind off RAM); the shorthands are every block of their kinds
      spill_staging       with spill: that many sets of host staging buffers (each: one chunk per
                          spilled kind, fp32), so reads run ahead of AdamW and writes behind it
      expert_group_size   a sparse layer streams as its dense part and groups of this many experts: slots and
                          gradient buffers hold the largest part, not the layer (None / 0: whole layers)
      spill_chunk_bytes   with spill: the I/O and AdamW unit; a larger block (the embedding, lm_head) is read,
                          updated and written in pieces of this many bytes: every spill buffer is bounded by it
      compiled_layers     the dense decoder layers' forward (so their recompute and backward) through torch.compile,
                          its elementwise work fused: no buffer of its own; the fused kernels' intermediates stand in
                          for eager's ([Note: compiled layers] in runtime/model/compiled_layers.py)
    """

    version: int = PLAN_VERSION
    # Device weight slots (K >= 2: one computing while the next one loads).
    num_slots: int = 2
    # Blocks loaded ahead of the one computing (1 <= depth <= K - 1).
    prefetch_depth: int = 1
    # Sequences per micro-batch; a step runs ceil(batch / micro_batch_size) micro-batches.
    micro_batch_size: int = 1
    # Where activation checkpoints at block boundaries live between forward and backward.
    checkpoints: str = "device"
    # checkpoints="host": tokens per copy of a checkpoint to the host and back, each with its own event
    # (None: a micro-batch's input in one copy).
    checkpoint_piece_tokens: int | None = None
    # "eager": AdamW per block as soon as its grads reach the host (no clipping possible);
    # "deferred": after backward, in forward order, overlapping the next step's forward.
    optimizer_mode: str = "deferred"
    # "worker": AdamW on a thread of its own, beside compute; "compute": each update as it is queued, on the thread
    # of the step, with all its intra-op threads (a CPU device, whose cores compute holds; nothing spilled).
    adam_thread: str = "worker"
    # A CPU device computing on each block's weights and gradients where they are in host RAM: no slot or gradient
    # buffer copied or held (deferred mode, masters and gradients in RAM, whole layers, one process).
    compute_in_place: bool = False
    # bf16 / fp16: "host" (AdamW rounds the master into a shadow the loads copy) or "device" (the loads round it).
    weights_cast: str = "host"
    # Device fp32 gradient accumulators in flight (one accumulating, one draining to host).
    device_grad_buffers: int = 2
    # Eager mode: host fp32 gradient slabs between D2H and AdamW.
    host_grad_slabs: int = 2
    # Tokens per chunk of the chunked cross-entropy (bounds the logits buffer).
    loss_chunk_tokens: int = 4096
    # Tokens per sequence tile of the MLP with its norm, forward and backward (None: the whole sequence at once).
    mlp_tile_tokens: int | None = None
    # Tokens per sequence tile of the attention half's token-local work (input norm, q/k/v projections and RoPE,
    # o_proj), forward and backward, around one attention call over the whole sequence (None: untiled).
    attention_tile_tokens: int | None = None
    # Experts per group a sparse layer streams in, apart from its dense part (None or 0: whole layers).
    expert_group_size: int | None = None
    # Decoder layers (0..L-1) whose activations are kept for backward (no recompute); the others are recomputed
    # from their boundary checkpoints ([Note: kept layers] in runtime/pipeline/kept_layers.py).
    kept_layers: tuple[int, ...] = ()
    # Blocks whose fp32 master, m, v and gradient live in device memory and are updated there (empty: none).
    resident_blocks: tuple[int, ...] = ()
    # What lives in spill files instead of host RAM: "none", "optimizer" (m, v), "all" (fp32 master, m, v, grads),
    # or "blocks" (per kind, the blocks spill_blocks names).
    spill: str = "none"
    # spill="blocks": per kind (master, exp_avg, exp_avg_sq, grads), the blocks whose state lives on disk.
    spill_blocks: SpillBlocks | None = None
    # Directory for the spill files (needed when spill != "none"); preallocated at start.
    spill_dir: str | None = None
    # Staging sets in flight between the disk and CPU AdamW (reads ahead, writes behind).
    spill_staging: int = 3
    # Bytes of one spill I/O and AdamW chunk (a multiple of 4096): bounds staging sets and gradient slabs.
    spill_chunk_bytes: int = 64 * 2**20
    # Spill I/O: "posix" (thread pool of preadv/pwritev, O_DIRECT where the filesystem takes it),
    # "kvikio" (GPUDirect Storage / its compatibility mode; needs the [gds] extra and a CUDA driver), "auto".
    io_backend: str = "auto"
    # Threads of the POSIX backend.
    io_threads: int = 4
    # POSIX backend: O_DIRECT where the filesystem takes it (True), or buffered I/O only; the planner
    # picks the faster as the profile measured it.
    io_direct: bool = True
    # The same for reads alone (None: as io_direct; the planner leaves it so): a disk can read faster buffered
    # (the kernel's read-ahead, 3.2 against 1.7 GB/s here) and write faster with O_DIRECT (2.5 against 0.5).
    io_direct_reads: bool | None = None
    # The dense decoder layers' forward through torch.compile (elementwise work fused; attention the same kernel).
    compiled_layers: bool = False
    # The workload the planner chose this plan for (None: a hand-made plan, not checked).
    workload: WorkloadFingerprint | None = None

    def __post_init__(self) -> None:
        if self.version != PLAN_VERSION:
            raise PlanError(
                f"plan version {self.version!r} is not supported (this megatrain reads version "
                f"{PLAN_VERSION}); write the plan again with this release's megatrain-plan"
            )
        at_least("num_slots", self.num_slots, 2, "the pipeline needs one slot computing and one loading")
        at_least("prefetch_depth", self.prefetch_depth, 1, "use 1 for double buffering")
        if self.prefetch_depth > self.num_slots - 1:
            raise PlanError(
                f"prefetch_depth={self.prefetch_depth} needs at least {self.prefetch_depth + 1} slots "
                f"but num_slots={self.num_slots}; raise num_slots or lower prefetch_depth"
            )
        at_least("micro_batch_size", self.micro_batch_size, 1, "it counts sequences per micro-batch")
        one_of("checkpoints", self.checkpoints, CHECKPOINT_PLACEMENTS)
        if self.checkpoint_piece_tokens is not None:
            at_least("checkpoint_piece_tokens", self.checkpoint_piece_tokens, 1,
                      "it is the number of tokens per checkpoint copy, or null for whole micro-batches")
        one_of("optimizer_mode", self.optimizer_mode, OPTIMIZER_MODES)
        one_of("adam_thread", self.adam_thread, ADAM_THREADS)
        one_of("weights_cast", self.weights_cast, WEIGHTS_CASTS)
        at_least("device_grad_buffers", self.device_grad_buffers, 2,
                  "one buffer accumulates while the previous one drains to the host")
        at_least("host_grad_slabs", self.host_grad_slabs, 1, "eager mode needs somewhere to land gradients")
        _check_loss_chunk(self)
        if self.mlp_tile_tokens is not None:
            at_least("mlp_tile_tokens", self.mlp_tile_tokens, 1, "it is the number of tokens per MLP tile, or null")
        if self.attention_tile_tokens is not None:
            at_least("attention_tile_tokens", self.attention_tile_tokens, 1,
                      "it is the number of tokens per tile of the attention's projections, or null")
        if self.expert_group_size is not None:
            at_least("expert_group_size", self.expert_group_size, 0, "experts per group, or 0 / null for whole layers")
        _check_kept_layers(self)
        object.__setattr__(self, "resident_blocks", resident_block_numbers(self.resident_blocks))
        one_of("spill", self.spill, SPILL_CHOICES)
        _check_spill_blocks(self)
        one_of("io_backend", self.io_backend, IO_BACKENDS)
        at_least("spill_staging", self.spill_staging, 1, "AdamW needs one staging set to work in")
        at_least("io_threads", self.io_threads, 1, "the POSIX backend needs a thread")
        if not isinstance(self.io_direct, bool):
            raise PlanError(f"io_direct={self.io_direct!r} must be true or false")
        if self.io_direct_reads is not None and not isinstance(self.io_direct_reads, bool):
            raise PlanError(f"io_direct_reads={self.io_direct_reads!r} must be true, false or null (as io_direct)")
        at_least("spill_chunk_bytes", self.spill_chunk_bytes, SPILL_CHUNK_ALIGN, "it is the unit of spill I/O")
        if self.spill_chunk_bytes % SPILL_CHUNK_ALIGN:
            raise PlanError(f"spill_chunk_bytes={self.spill_chunk_bytes} must be a multiple of {SPILL_CHUNK_ALIGN} "
                            "(the spill files' alignment); round it to one")
        check_host_device(self)
        check_resident(self)
        check_compiled(self)
        if self.spill != "none" and not self.spill_dir:
            raise PlanError(f"spill={self.spill!r} needs spill_dir: name a directory on a fast local disk (--spill-dir)")
        if self.spill_dir is not None and not isinstance(self.spill_dir, str):
            raise PlanError(f"spill_dir={self.spill_dir!r} must be a directory path (a string)")
        if isinstance(self.workload, Mapping):  # from JSON
            object.__setattr__(self, "workload", fingerprint_from_dict(self.workload))
        if self.workload is not None and not isinstance(self.workload, WorkloadFingerprint):
            raise PlanError(f"workload={self.workload!r} must be a WorkloadFingerprint or None")

    def check_kept_layers(self, num_layers: int) -> None:
        """Refuse a kept layer the model does not have (one line)."""
        bad = [b for b in self.kept_layers if b >= num_layers]
        if bad:
            raise PlanError(f"kept_layers names layer {bad[0]}, but this model has {num_layers} decoder layers "
                            f"(0 .. {num_layers - 1}); plan again for this model with megatrain-plan plan")

    def spill_placement(self, num_blocks: int) -> dict[str, tuple[int, ...]]:
        """Per kind (``SPILL_KINDS``), the blocks of a model of ``num_blocks`` blocks whose state lives in spill
        files: a shorthand's kinds on every block, or ``spill_blocks`` (refused when it names a block the model
        does not have)."""
        if self.spill != "blocks":
            every = tuple(range(num_blocks))
            return {k: every if k in SPILL_SHORTHANDS[self.spill] else () for k in SPILL_KINDS}
        assert self.spill_blocks is not None
        for kind in SPILL_KINDS:
            bad = [b for b in self.spill_blocks.blocks(kind) if b >= num_blocks]
            if bad:
                raise PlanError(f"spill_blocks.{kind} names block {bad[0]}, but this model has {num_blocks} blocks "
                                f"(0 .. {num_blocks - 1}); plan again for this model with megatrain-plan plan")
        return {k: self.spill_blocks.blocks(k) for k in SPILL_KINDS}

    def check_workload(self, shape_digest: str, seq_len: int, batch: int, compute_dtype: str) -> None:
        """Refuse a workload this plan was not made for (one line naming the difference); a hand-made
        plan (no fingerprint) is not checked."""
        if self.workload is not None:
            self.workload.check_model(shape_digest, compute_dtype)
            self.workload.check_batch(batch, seq_len)

    def replace(self, **changes: Any) -> "Plan":
        """This plan with ``changes``, checked as a new one is (``_replaced``)."""
        return _replaced(self, changes)

    @property
    def direct_reads(self) -> bool:
        """Whether spill reads use O_DIRECT (where the filesystem takes it): ``io_direct_reads``, else ``io_direct``."""
        return self.io_direct if self.io_direct_reads is None else self.io_direct_reads

    def to_dict(self) -> dict[str, Any]:
        out = {**dataclasses.asdict(self), "kept_layers": list(self.kept_layers)}  # as JSON has it
        out["resident_blocks"] = list(self.resident_blocks)
        # these two written only when set (some resident blocks; compiled layers): a plan without them reads as before
        return {k: v for k, v in out.items() if v or k not in ("resident_blocks", "compiled_layers")}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        if not isinstance(data, dict):
            raise PlanError(f"a plan is a JSON object, got {type(data).__name__}; pass the file megatrain-plan wrote")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"unknown plan field(s) {', '.join(unknown)}; valid fields: {', '.join(sorted(known))}")
        if "version" not in data:
            raise PlanError("plan has no 'version' field; write it again with megatrain-plan")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan is not valid JSON ({e.msg} at line {e.lineno}); pass the file megatrain-plan wrote") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str) -> "Plan":
        try:
            with open(path, encoding="utf-8") as f:
                return cls.from_json(f.read())
        except OSError as e:
            raise PlanError(f"cannot read plan file {path}: {e.strerror}; check the path") from None

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")


# Plan's fields, what Plan.replace copies.
_FIELDS = frozenset(f.name for f in dataclasses.fields(Plan))


def _replaced(plan: Plan, changes: dict[str, Any]) -> Plan:
    """``plan`` with ``changes``, checked as a new one is (``Plan.__post_init__``). As ``dataclasses.replace``, without
    its call of ``__init__`` by keyword: the search makes tens of thousands of plans."""
    unknown = changes.keys() - _FIELDS
    if unknown:
        raise TypeError(f"Plan has no field(s) {', '.join(sorted(unknown))}")
    new = object.__new__(type(plan))
    values = new.__dict__
    for name in _FIELDS:
        values[name] = changes[name] if name in changes else plan.__dict__[name]
    if len(changes) == 1 and next(iter(changes)) in _OWN_CHECKS:
        _OWN_CHECKS[next(iter(changes))](new)  # the rest was checked when ``plan`` was made
    else:
        new.__post_init__()
    return new


def _check_loss_chunk(plan: Plan) -> None:
    at_least("loss_chunk_tokens", plan.loss_chunk_tokens, 1, "it is the number of tokens per logits chunk")


def _check_kept_layers(plan: Plan) -> None:
    object.__setattr__(plan, "kept_layers", kept_layer_numbers(plan.kept_layers))


# The fields whose check reads no other field and no other field's check reads (``Plan.__post_init__``): a plan
# with only one of them changed needs only its check. The search changes these two tens of thousands of times.
_OWN_CHECKS = {"loss_chunk_tokens": _check_loss_chunk, "kept_layers": _check_kept_layers}


def _check_spill_blocks(self: "Plan") -> None:
    """``Plan.spill_blocks`` read from JSON and checked against ``spill``."""
    if isinstance(self.spill_blocks, Mapping):  # from JSON
        known = set(SPILL_KINDS)
        if not set(self.spill_blocks) <= known:
            raise PlanError(f"spill_blocks has keys {', '.join(sorted(self.spill_blocks))}; the kinds are "
                            f"{', '.join(SPILL_KINDS)}")
        object.__setattr__(self, "spill_blocks", SpillBlocks(**self.spill_blocks))
    if self.spill_blocks is not None and not isinstance(self.spill_blocks, SpillBlocks):
        raise PlanError(f"spill_blocks={self.spill_blocks!r} must be a SpillBlocks, a JSON object or None")
    if self.spill == "blocks" and (self.spill_blocks is None or self.spill_blocks.empty):
        raise PlanError("spill='blocks' needs spill_blocks naming at least one block of one kind; "
                        "or use spill='none'")
    if self.spill != "blocks" and self.spill_blocks is not None:
        raise PlanError(f"spill_blocks is read only with spill='blocks' (spill={self.spill!r}); "
                        "set spill='blocks' or drop spill_blocks")


def default_plan(clipping: bool, device_is_host: bool = False) -> Plan:
    """The plan the runtime uses when none is given, until a measured one exists.

    Two slots, prefetch one block ahead, checkpoints on the device; the optimizer
    overlaps backward unless clipping needs every block's gradient norm first, and
    runs on the compute thread where the device is the CPU (``adam_thread``). Its
    micro-batch is open: the Engine sets it to the first training step's batch (this
    rank's share), so a batch is never split unless a plan says so.
    """
    mode = "deferred" if clipping else "eager"
    return Plan(optimizer_mode=mode, **host_device_choices(device_is_host, mode, "none"))


def host_device_choices(device_is_host: bool, optimizer_mode: str, spill: str) -> dict[str, Any]:
    """What a plan does where the device is the CPU (``device_is_host``, one process), as ``Plan`` fields:
    ``adam_thread`` "compute" when nothing spills (the cores are compute's, so a worker thread would only take
    them in turn, on one intra-op thread), else "worker" (beside a GPU's compute, or waiting on spill I/O); and
    ``compute_in_place`` in deferred mode with every master and gradient in RAM (copying a block from host RAM
    to host RAM buys nothing)."""
    return {"adam_thread": "compute" if device_is_host and spill == "none" else "worker",
            "compute_in_place": device_is_host and optimizer_mode == "deferred" and spill in ("none", "optimizer")}
