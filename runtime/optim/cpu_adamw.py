"""CPU AdamW on each block's flat fp32 buffers, in a worker thread.

The math is torch's fused CPU AdamW kernel (``torch._fused_adamw_``, what
``torch.optim.AdamW(fused=True)`` runs), called once per block for the
parameters with weight decay and once for those without, on lists of views of
the block's flat buffers. Views, not one flat range: the kernel's vectorized
body and its scalar tail round differently (the tail of each tensor, and of each
thread's chunk, differs by 1 ULP in exp_avg_sq), so only the same tensor
boundaries as ``torch.optim.AdamW`` give the same bits. With
clipping, the gradients are first multiplied by the clip coefficient the way
``torch.nn.utils.clip_grad_norm_`` does (``grad * clamp(max_norm / (norm + 1e-6), max=1)``).
With bf16 m and v the update is bf16_adamw.py's one pass instead (the clip
coefficient applied inside it; [Note: bf16 optimizer state]).

[Note: optimizer modes]
eager: a block's job is queued as soon as its gradient drain is queued, so the
update overlaps the rest of backward. deferred: every job is queued after
backward, in forward order, so block 0 is updated first and the next step's
forward, which loads block 0 first, waits the least. In both, the next load of
block b waits for ``wait_updated(b)``. The job queue holds at most one job per
block (its bound); the worker releases an eager-mode gradient slab when done.
With ``Plan.adam_thread == "compute"`` there is no worker: ``submit`` runs the
job at once on the calling thread (the compute thread, every intra-op thread of
it), so eager updates run inside backward and deferred ones at the end of the
step, where ``torch.optim.AdamW`` would run them ([Note: helper threads]).

With spilled kinds the worker keeps up to ``spill_staging`` chunks in flight and asks the read-ahead
(read_ahead.py, [Note: spill read-ahead]) for each chunk's staged state and to write it back behind; which
chunks it reads ahead, across the step boundary in the step schedule's update order, is the read-ahead's
business. A block with something spilled that is larger than ``Plan.spill_chunk_bytes`` is updated chunk by
chunk (the same bits: ``buffer_kinds.spill_chunks``), and counts as updated after its last chunk.

[Note: non-finite updates]
With ``OptimizerConfig(skip_nonfinite=True)`` a non-finite gradient skips the
update instead of writing NaN into the masters and AdamW state (the block's
master, m, v and AdamW step stay as they were); the worker records the step and
the engine warns. No host sync is added: the worker looks at what it already
has on the host. With clipping (deferred mode) that is the clip coefficient,
``max_norm / (norm + 1e-6)``, NaN or 0 exactly when the global norm is NaN or
infinite: the whole step is skipped, every block alike. Without clipping (eager
mode, or deferred without ``max_grad_norm``) there is no global norm on the
host before updates start, so each block checks its own gradient (one extra
read of it) and only blocks with a non-finite gradient are skipped; in eager
mode the blocks updated before one is found keep their update. A NaN or
infinite loss makes every gradient non-finite, so the whole step goes either way.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.profiler import record_function

from megatrain.runtime.errors import MegatrainError
from megatrain.runtime.device import host_threads
from megatrain.runtime.device.event_log import EventLog
from megatrain.plan.buffer_kinds import BufferKind

from megatrain.runtime.state.host_store import HostStore
from megatrain.runtime.spill.read_ahead import ReadAhead
from megatrain.runtime.spill.staging_pool import Staged
from megatrain.runtime.device.streams import Event
from megatrain.runtime.model.templates import BlockLayout
from megatrain.runtime.optim import bf16_adamw
from megatrain.runtime.optim.adamw_kernel import AdamHyper, fused_adamw
from megatrain.runtime.optim.job_queue import EMPTY, JobQueue



@dataclass
class AdamJob:
    step: int
    block: int
    grads: torch.Tensor | None  # fp32 host [numel] written by the D2H drain; None: read from the grads file
    grads_ready: Event  # the drain's completion
    clip: tuple[torch.Tensor, Event] | None  # (host fp32 scalar coefficient, its D2H completion)
    hyper: AdamHyper
    layout: BlockLayout
    on_done: Callable[[], None] | None = None  # e.g. release the eager gradient slab
    skip: bool = False  # decided with the block's first piece: the update is skipped (non-finite)


class AdamWorker:
    """The worker thread: waits for a job's inputs, updates the block, refreshes its shadow and signals it.
    With spill files, ``ahead`` (read_ahead.py) stages each piece's spilled state and writes it back."""

    def __init__(self, store: HostStore, order: Sequence[int], blocks: int, log: EventLog, threads: int | None = None,
                 inline: bool = False) -> None:
        """``order``: the blocks in the order every step's jobs come (``StepSchedule.update_order``, less the blocks
        updated on the device); ``blocks``: the model's;
        ``threads``: its kernels' intra-op threads (``host_threads.helper_threads``: one where the device is the
        CPU, a rank's share of its node's cores on a GPU; None, the process's: [Note: helper threads]);
        ``inline``: no thread, each job runs in ``submit`` (nothing spilled)."""
        assert not (inline and store.disk is not None), "refused by Plan: adam_thread='compute' with spill"
        self.store = store
        self.inline = inline
        self.log = log
        self._jobs: JobQueue[AdamJob | None] = JobQueue()  # a job per block of a step, and the closing None
        self._order = tuple(order)
        self._updated = [0] * blocks  # last step whose update of block b is complete
        self._cond = threading.Condition()
        # Per step: seconds the worker spent updating (not waiting for drains or reads), and jobs done.
        self._busy: dict[int, list[float]] = {}
        self._busy_complete: float | None = None  # the latest step whose every block is updated
        self._error: BaseException | None = None
        self._read_wait = 0.0  # cumulative: blocked on spill reads landing
        self._skipped: list[int] = []  # steps with a skipped block update, not yet taken by take_skipped()
        if store.state_dtype == torch.bfloat16:  # built (or loaded from the cache) now, not in the first step
            bf16_adamw.kernel()
        self.ahead: ReadAhead | None = None if store.disk is None else store.disk.read_ahead(order, log)
        self._thread = None if inline else host_threads.start(self._run, "megatrain-adamw", threads)

    def submit(self, job: AdamJob) -> None:
        self.raise_if_failed()
        if not self.inline:
            self._jobs.put(job)
            return
        try:
            (lo, n), = self._take(job)
            self._update(job, lo, n, True, None)
        except BaseException as e:  # every later wait raises it, as the worker's would (none waits for ever)
            with self._cond:
                self._error = e
                self._cond.notify_all()
            raise
        self._done(job)

    def wait_updated(self, block: int, step: int) -> None:
        """Block until block's update for ``step`` (and all before it) is done."""
        with self._cond:
            while self._updated[block] < step and self._error is None:
                self._cond.wait()
        self.raise_if_failed()

    def wait_all(self, step: int) -> None:
        for b in self._order:
            self.wait_updated(b, step)

    def restore(self, step: int) -> None:
        """After a checkpoint load, before any job: every block's update up to ``step`` counts as applied."""
        with self._cond:
            self._updated = [step] * len(self._updated)

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    @property
    def busy_seconds(self) -> float | None:
        """Update seconds of the latest step whose updates all finished (None before the first)."""
        return self._busy_complete

    @property
    def disk_wait_seconds(self) -> float:
        """Cumulative: blocked on spill reads or on a staging set being written back."""
        return self._read_wait + (self.ahead.wait_seconds if self.ahead is not None else 0.0)

    def _account(self, step: int, seconds: float, last: bool = True) -> None:
        entry = self._busy.setdefault(step, [0.0, 0])
        entry[0] += seconds
        entry[1] += 1 if last else 0
        if entry[1] == len(self._order):
            self._busy_complete = entry[0]
            for s in [s for s in self._busy if s <= step]:
                del self._busy[s]

    def take_skipped(self) -> list[int]:
        """Steps (each once) whose update was skipped for a non-finite gradient since the last call."""
        with self._cond:
            steps, self._skipped = sorted(set(self._skipped)), []
        return steps

    def raise_if_failed(self) -> None:
        if self._error is not None:
            if isinstance(self._error, MegatrainError):  # e.g. a spill I/O error: its own one-line message
                raise type(self._error)(f"{self._error}; training stopped") from self._error
            raise RuntimeError(f"the CPU AdamW update failed: {self._error!r}") from self._error

    def _run(self) -> None:
        ahead = self.ahead
        depth = ahead.depth if ahead is not None else 1
        inflight: collections.deque[tuple[AdamJob, int, int, bool, Staged | None]] = collections.deque()
        pending: collections.deque[tuple[AdamJob, int, int, bool]] = collections.deque()  # pieces not yet staged
        closing = False
        landing: cf.Future | None = None  # the disk's next landing, after which the read-ahead looks again
        try:
            while True:
                # Take pieces ahead (up to ``depth``) and start reading their spilled state.
                while len(inflight) < depth:
                    if not pending:
                        if closing:
                            break
                        job = self._jobs.take()
                        if job is EMPTY or (landing is not None and landing.done()):
                            # the queue is dry, or a transfer landed: the next chunks in order, into the sets free now
                            landing = ahead.read_ahead(idle=True) if ahead is not None else None
                            if job is EMPTY:
                                if inflight:
                                    break
                                job = self._jobs.wait(landing)  # the next job, or EMPTY once the landing
                                if job is EMPTY:
                                    continue
                        if job is None:
                            closing = True
                            continue
                        pieces = self._take(job)
                        pending.extend((job, lo, n, i == len(pieces) - 1) for i, (lo, n) in enumerate(pieces))
                    job, lo, n, last = pending.popleft()
                    inflight.append((job, lo, n, last, self._stage(job, lo, n)))
                if not inflight:
                    if ahead is not None:
                        ahead.drop()
                    return
                job, lo, n, last, staged = inflight.popleft()
                self._update(job, lo, n, last, staged)
                if last:
                    self._done(job)
        except BaseException as e:  # surfaced to the training thread at its next wait
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _done(self, job: AdamJob) -> None:
        """Job's block is updated for its step: its loads may go."""
        with self._cond:
            self._updated[job.block] = job.step
            self._cond.notify_all()

    def _take(self, job: AdamJob) -> list[tuple[int, int]]:
        """Take ``job`` (the read-ahead notes it); the (first element, elements) pieces its update walks: the spill
        chunks when something of the block spills, else the whole block."""
        if self.ahead is None:
            return [(0, self.store.numels[job.block])]
        self.ahead.taken(job.step, job.block)
        return self.ahead.pieces(job.block)

    def _stage(self, job: AdamJob, lo: int, n: int) -> Staged | None:
        """The piece's spilled state on its way into a staging set (None: nothing of it is on disk); the gradients
        too when they come from their file."""
        if self.ahead is None:
            return None
        return self.ahead.stage(job.step, job.block, lo, n, grads=job.grads is None)

    def _update(self, job: AdamJob, lo: int, n: int, last: bool, staged: Staged | None) -> None:
        """Update block ``job.block``'s elements [lo, lo + n) (``last``: the block's last piece)."""
        b, store, h = job.block, self.store, job.hyper
        if lo == 0:
            self.log.record("adam_begin", job.step, b)
        with record_function(f"adam_wait[{b}]"):  # the drain, the spilled reads, the clip coefficient
            job.grads_ready.synchronize()
            t0 = time.perf_counter()
            for r in (staged.reads if staged is not None else ()):
                r.result()
            self._read_wait += time.perf_counter() - t0
            if job.clip is not None:
                job.clip[1].synchronize()
        with record_function(f"adam[{b}]"):  # the update itself: what adam_busy_s and traces count
            t0 = time.perf_counter()
            buffers = staged.buffers if staged is not None else {}

            def buf(kind: BufferKind) -> torch.Tensor:
                return buffers[kind][:n] if kind in buffers else store.read_block(kind, b)[lo:lo + n]
            grads = job.grads[lo:lo + n] if job.grads is not None else buffers[BufferKind.GRADS][:n]
            if lo == 0:
                job.skip = h.skip_nonfinite and not _finite(job, self._whole_grads(job, grads, n))
                if job.skip:
                    with self._cond:
                        self._skipped.append(job.step)
            if not job.skip:
                self._apply(job, lo, n, grads, buf)
            self._account(job.step, time.perf_counter() - t0, last)
        if staged is not None:
            assert self.ahead is not None
            self.ahead.write_behind(job.step, b, n, staged)
        if last:
            if job.on_done is not None:
                job.on_done()
            self.log.record("adam_end", job.step, b)

    def _whole_grads(self, job: AdamJob, first: torch.Tensor, n: int) -> torch.Tensor:
        """The block's whole gradient for the non-finite check: the first piece when it is the whole block,
        else the block's gradient in RAM, or read back from the grads file (one extra read, only when
        skipping non-finite updates without clipping)."""
        numel = self.store.numels[job.block]
        if n == numel or job.clip is not None:
            return first
        if job.grads is not None:
            return job.grads
        return self.store.read_block(BufferKind.GRADS, job.block)

    def _apply(self, job: AdamJob, lo: int, n: int, grads: torch.Tensor,
               buf: Callable[[BufferKind], torch.Tensor]) -> None:
        """The update of elements [lo, lo + n) of one block: clip, fused AdamW on its views (bf16 m and v, in RAM
        or a staging set alike: one pass that widens them, updates and rounds them back, the clip coefficient
        inside it, [Note: bf16 optimizer state]), the compute-dtype shadow. The step count advances once per
        block, with its first piece."""
        b, store = job.block, self.store
        master = buf(BufferKind.MASTER)
        m, v = buf(BufferKind.EXP_AVG), buf(BufferKind.EXP_AVG_SQ)
        step = store.steps[b]
        if lo == 0:
            step.add_(1)
        if m.dtype == torch.float32:
            if job.clip is not None:
                grads.mul_(job.clip[0])
            _fused_adamw(job, lo, n, (master, grads, m, v), step)
        else:  # the clip coefficient: on the host already, waited for in _update
            clip = float(job.clip[0]) if job.clip is not None else None
            bf16_adamw.update_entries(job.hyper, job.layout, lo, (master, grads, m, v), int(step), b, clip)
        if store.shadow is not store.master and store.shadow is not None:
            with record_function(f"shadow[{b}]"):  # the compute-dtype copy that travels H2D
                store.refresh_shadow(b, master, lo)


def _fused_adamw(job: AdamJob, lo: int, n: int, flats: tuple[torch.Tensor, ...], step: torch.Tensor) -> None:
    """adamw_kernel.py's fused AdamW on the elements [lo, lo + n) of job's block (``flats``: those of its master,
    grads, m and v)."""
    fused_adamw(job.hyper, job.layout, lo, n, flats, step)


def _finite(job: AdamJob, grads: torch.Tensor) -> bool:
    """Whether the job's update may run (see [Note: non-finite updates]): the clip coefficient when there is one
    (on the host already, waited for: no device sync), else this block's own gradient."""
    if job.clip is not None:
        coefficient = float(job.clip[0])
        return math.isfinite(coefficient) and coefficient > 0
    return bool(torch.isfinite(grads).all())
