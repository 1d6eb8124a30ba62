"""The loader thread: spilled fp32 masters read into weight slots off the thread that launches compute.

[Note: spilled loads]
In fp32 a block whose master is spilled has no copy of its weights in host RAM
(``HostStore.load_source`` is None): its load reads the master spill file. A load
issued ahead (``prefetch_depth``) hands that to the loader thread as a job and
returns at once; compute waits for the job only when it acquires the slot. A job,
in load order, one at a time:

1. taps the block's master (CPU slots: ``SpilledState.tap_master``): each chunk of
   it that AdamW's update writes behind from now on is copied into the slot as
   well, so that chunk need not be read back from the disk it was just written to;
2. waits for AdamW's update of the block for the step before (``updated``:
   compute's wait on it is exposed optimizer time; the thread asks the optimizer,
   ``BlockOptimizer.wait_updated``), then ends the tap;
3. reads what the tap did not copy (all of it, where the update was done or under
   way before the tap), each read after the update's write of it lands, but for
   the chunks the AdamW worker read ahead for the block's next update, which it
   copies from their staging set ([Note: lent masters] in runtime/spill/lent_masters.py):
   - on a CPU straight into the slot (4 KiB-aligned, O_DIRECT where the
     filesystem takes it), every chunk in flight at once on the I/O threads;
     compute waits for the reads (``landed``'s result: exposed disk time);
     a load's reads go before the transfers queued for AdamW (``first``);
   - on CUDA through two pinned bounce buffers of one spill chunk each, the H2D
     copy of one on the h2d stream overlapping the read of the next; the job
     records the slot's ``loaded`` event after its last copy, before ``landed``
     is set, so the compute stream never waits on an event not yet recorded.

Jobs run one at a time, so a block has one tap at most. A tapped chunk holds the
bytes its write puts on disk (the copy is taken from the staging set before the
write is issued), and the update that wrote it is the one the load waits for: the
next update of the block comes after compute has used the load.

Before this thread, those waits and the CUDA path's chunk-by-chunk reads ran
inside the prefetch: compute of load j waited for the update and the read of
load j + ``prefetch_depth``.

Data parallel, the rank's shard is read on the calling thread instead
(``read_now``): the slot's all-gather follows at once.

Bounds: one job per slot at most (a slot takes a new load only once its last was
acquired, and acquiring waits for the job), so the queue holds at most K jobs.
Memory: none on a CPU; two pinned spill chunks on CUDA, whatever the block's size.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import queue
from typing import NamedTuple

import torch

from megatrain.runtime.device import host_threads
from megatrain.runtime.device.streams import Event, Streams
from megatrain.runtime.optim.block_optimizer import BlockOptimizer
from megatrain.runtime.pipeline.step_timer import StepTimer
from megatrain.runtime.spill.spilled_state import SpilledState
from megatrain.runtime.spill.spill_io import aligned_empty


class SpilledLoad(NamedTuple):
    """A job's two milestones, each a future compute waits on when it acquires the slot."""

    updated: cf.Future  # AdamW's update of the block is done
    landed: cf.Future  # the block is in the slot; result: CPU reads still landing there (futures)


class SpilledLoads:
    """The loader thread and its bounce buffers ([Note: spilled loads])."""

    def __init__(self, disk: SpilledState, streams: Streams, optim: BlockOptimizer, timer: StepTimer,
                 bounce: bool, slots: int) -> None:
        """``disk``: the spilled state's face; ``optim``: asked whether a block is updated; ``bounce``: through
        pinned bounce buffers (CUDA slots), else straight into the slot (CPU slots); ``slots``: how many there
        are (the queue's bound: see the note)."""
        self.disk, self.streams, self.optim, self.timer = disk, streams, optim, timer
        self.bounce = bounce
        self._jobs: queue.Queue = queue.Queue(maxsize=slots + 1)  # (+1: the stop)
        self._thread = None
        self._buffers: list[torch.Tensor] = []  # bounce buffers, one spill chunk each
        self._copied: list[Event | None] = []  # per bounce buffer: the event of the H2D copy that last read it

    def submit(self, block: int, step: int, out: torch.Tensor, loaded: Event) -> SpilledLoad:
        """Read block ``block``'s master, as updated for ``step - 1``, into ``out`` (its slot's first elements);
        the h2d stream already waits for the slot's release. Returns at once."""
        if self._thread is None:  # on a CPU device it runs no kernel of its own ([Note: helper threads])
            self._thread = host_threads.start(self._run, "megatrain-loader", 1 if not self.streams.cuda else None)
        load = SpilledLoad(cf.Future(), cf.Future())
        self._jobs.put((block, step, out, loaded, load))
        return load

    def wait_written(self, block: int) -> None:
        """Data parallel: block until the update's writes of ``block``'s master (issued so far) have landed."""
        self.disk.wait_master_written(block)

    def read_now(self, block: int, out: torch.Tensor) -> None:
        """Data parallel: this rank's shard of the master into ``out`` on the calling thread, landed on return
        (the caller waited for the update and its write of the master)."""
        for read in self._read(block, out, None, timed=False):  # (the caller times its copies)
            read.result()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            block, step, out, loaded, load = job
            try:
                copied: set[int] = set()
                if not self.bounce:
                    self.disk.tap_master(block, out)
                try:
                    self.optim.wait_updated(block, step - 1)
                finally:
                    if not self.bounce:
                        copied = self.disk.untap(block)
                load.updated.set_result(None)
                with self.streams.h2d.use():
                    load.landed.set_result(self._read(block, out, loaded, timed=self.streams.cuda, skip=copied,
                                                      step=step))
            except BaseException as e:  # compute raises it when it acquires the slot
                for future in load:
                    if not future.done():
                        future.set_exception(e)

    def _read(self, block: int, out: torch.Tensor, loaded: Event | None, timed: bool,
              skip: set[int] = frozenset(), step: int | None = None) -> list[cf.Future]:
        """Block ``block``'s master into ``out``, but the chunks starting at ``skip`` (a tap copied them): the
        reads still landing (straight into ``out``), or none (through the bounce buffers, copies queued on the
        h2d stream, then ``loaded`` recorded there). Each read waits for the block's pending writes first. A
        load for ``step`` copies the chunks read ahead for that step's update instead ([Note: lent masters]).
        ``timed``: the copies count as the h2d link's busy time (CUDA; the timer's entries of a step are all
        added before its loads are acquired, so before it ends)."""
        disk = self.disk
        if not self.bounce:
            reads = (disk.read_master(block, out[lo:lo + n], lo, n, step) for lo, n in disk.chunks(block)
                     if lo not in skip)
            return [read for read in reads if read is not None]
        if not self._buffers:
            self._buffers = [_bounce_buffer(disk.chunk_numel, self.streams.cuda) for _ in range(2)]
            self._copied = [None, None]
        with self.timer.copy("h2d", self.streams.h2d) if timed else contextlib.nullcontext():
            for i, (lo, n) in enumerate(disk.chunks(block)):
                k = i % 2
                if self._copied[k] is not None:
                    self._copied[k].synchronize()  # the H2D copy that last read this bounce buffer
                read = disk.read_master(block, self._buffers[k], lo, n, step, exact=False)
                if read is not None:
                    read.result()
                out[lo:lo + n].copy_(self._buffers[k][:n], non_blocking=True)
                self._copied[k] = self.streams.recorded(self.streams.h2d)
        if loaded is not None:
            loaded.record(self.streams.h2d)
        return []


def _bounce_buffer(numel: int, pinned: bool) -> torch.Tensor:
    """One spill chunk of fp32, page-aligned (O_DIRECT): pinned for CUDA copies, else plain aligned memory."""
    if pinned:
        return torch.empty(numel, dtype=torch.float32, pin_memory=True)
    return aligned_empty(numel * 4).view(torch.float32)

