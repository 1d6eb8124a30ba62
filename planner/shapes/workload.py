"""Workload: what one training step is asked to do (sequence length, batch, dtype, clipping).

The model shape and hardware profile describe things; the Workload is the request the planner
answers. Pure stdlib.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatrain.errors import MegatrainError

from megatrain.planner.shapes.model_shapes import DTYPE_ALIASES, ModelShape, dtype_bytes
from megatrain.plan.plan import Plan
from megatrain.plan.workload_fingerprint import WorkloadFingerprint, shape_digest


class WorkloadError(MegatrainError):
    """A sequence length, batch or dtype the planner cannot plan for. One line: what, and the fix."""


OPTIMIZER_STATE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class Workload:
    """One optimizer step: ``batch`` sequences of ``seq_len`` tokens, computed in ``compute_dtype``.

    ``clipping`` is True when global-norm gradient clipping (max_grad_norm) is on: the optimizer must
    then run after backward ("deferred").
    """

    seq_len: int
    batch: int
    compute_dtype: str = "bfloat16"
    clipping: bool = True
    # What may spill to disk: "auto" (the search decides), or forced "none" / "optimizer" / "all".
    spill: str = "auto"
    # Where spill files go. No directory, no spill plan: the planner never picks one itself.
    spill_dir: str | None = None
    # Free bytes on the disk under spill_dir (None: not known, not checked).
    spill_free_bytes: int | None = None
    # AdamW m and v, in host RAM and in spill files: "fp32" (4 bytes each per parameter) or "bf16" (2 each).
    optimizer_state: str = "fp32"
    # The run saves checkpoints while it trains, without blocking the step: the save's snapshot of the master and
    # AdamW state is held beside the arenas (memory_model.checkpoint_snapshot).
    nonblocking_saves: bool = False

    def __post_init__(self) -> None:
        for f in ("seq_len", "batch"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise WorkloadError(f"{f}={v!r} must be an integer >= 1 (sequences / tokens per sequence)")
        if self.spill not in ("auto", "none", "optimizer", "all"):
            raise WorkloadError(f"spill={self.spill!r} must be auto, none, optimizer or all")
        if self.spill in ("optimizer", "all") and not self.spill_dir:
            raise WorkloadError(f"spill={self.spill!r} needs a directory for the spill files: pass --spill-dir DIR "
                                "on a fast local disk")
        if self.optimizer_state not in OPTIMIZER_STATE_BYTES:
            raise WorkloadError(f"optimizer_state={self.optimizer_state!r} must be fp32 or bf16")
        if self.spill_free_bytes is not None and (not isinstance(self.spill_free_bytes, int)
                                                  or self.spill_free_bytes < 0):
            raise WorkloadError(f"spill_free_bytes={self.spill_free_bytes!r} must be an integer >= 0 (bytes)")
        name = DTYPE_ALIASES.get(str(self.compute_dtype).lower())
        if name is None:
            raise WorkloadError(f"compute_dtype={self.compute_dtype!r} is unknown; use bf16, fp16 or fp32")
        object.__setattr__(self, "compute_dtype", name)

    @property
    def tokens(self) -> int:
        """Tokens per step (global batch tokens)."""
        return self.seq_len * self.batch

    @property
    def compute_bytes(self) -> int:
        return dtype_bytes(self.compute_dtype)

    @property
    def state_bytes(self) -> int:
        """Bytes per element of each of AdamW's m and v, in RAM and on disk."""
        return OPTIMIZER_STATE_BYTES[self.optimizer_state]

    def spill_choices(self) -> tuple[str, ...]:
        """The spill values of the search's candidates: with "auto", "none" and, where there is a directory, "all",
        which the search then fills back down to the least spill that fits (search.py, [Note: fill order])."""
        if self.spill == "auto":
            return ("none", "all") if self.spill_dir else ("none",)
        return (self.spill,)

    def fingerprint(self, model: ModelShape) -> WorkloadFingerprint:
        """What a plan for this workload records, so that the runtime can refuse another workload."""
        return WorkloadFingerprint(model.name, model.params, shape_digest(model.config_dims()), self.seq_len,
                                   self.batch, self.compute_dtype)

    def micro_batches(self, micro_batch_size: int) -> int:
        """M = ceil(batch / micro_batch_size)."""
        return -(-self.batch // micro_batch_size)


@dataclass(frozen=True)
class StepBatch:
    """The step's tokens as a plan cuts them (the cost model's unit)."""

    tokens: int          # T = batch x seq
    seq: int
    micro_batches: int   # M = ceil(batch / mbs)
    micro_tokens: int    # t = mbs x seq, tokens per micro-batch
    loss_chunks: int     # chunks per micro-batch = ceil(t / min(loss_chunk_tokens, t))

    @classmethod
    def of(cls, work: Workload, plan: Plan) -> "StepBatch":
        mbs = min(plan.micro_batch_size, work.batch)
        t = mbs * work.seq_len
        return cls(work.tokens, work.seq_len, work.micro_batches(mbs), t, -(-t // min(plan.loss_chunk_tokens, t)))
