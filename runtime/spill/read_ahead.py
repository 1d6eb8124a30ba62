"""The AdamW worker's spill I/O: each chunk's spilled state staged ahead of its update, across the step boundary
too, and written back behind it.

[Note: spill read-ahead]
The worker keeps up to ``spill_staging`` chunks in flight (``depth``): it asks for
each chunk's staging set when it takes the chunk (``stage``: the reads of the
chunk's spilled kinds are issued then; the block's kinds in RAM are updated in
place), updates the oldest once its reads land, and hands it back (``write_behind``);
a set returns to the pool when its writes finish.

Across the step boundary: every step updates the blocks in one known order, the
step schedule's (``StepSchedule.update_order``, handed over as plain block
numbers). Once every job of a step is taken (``taken``), the chunks of the next
step, in that order, are the ones to read ahead: when the worker's queue runs dry
(``read_ahead``) their master, m and v (nothing writes those between two updates
of a block; the gradients are read when the job comes, after their drain's
writes) go into the sets the worker does not hold, so the disk works while the
next step's jobs are still being computed (deferred mode: all of backward; eager
mode: the forward, whose disk only loads). The list lasts through that step: as
its jobs come one by one (eager mode: each block's after its backward) the
worker's idle moments read the chunks of the jobs still to come, so a block's
master, m and v are staged before its gradient is, and only the gradient reads
and the writes wait for its backward. A chunk is read ahead only once its own
update of the step before has issued its writes (the read waits for them). The
job that comes takes its set and adds the gradient reads
(``SpillFiles.stage_more``). A chunk asked for out of that order (the step's
order changed), or after a cold-path write to the files (their ``version`` moved
since the read), drops everything read ahead (``discard``) and is read afresh.

A read ahead never makes the worker wait (``read_ahead(idle=True)``). The next step's
chunks (read while this step's last updates write and the next forward loads) are
read only when nothing is in flight on the disk (``_disk_idle``), so the reads of a
load and the writes of an update queue behind one chunk's reads ahead at most, never
behind a step's worth of them; and with nothing in flight no set is being written
back, so it never waits for one while the worker has updates to run (waiting there
had held the last block's update for seconds behind writes). Once that step's jobs
come (eager: its backward), its chunks still to come are read into the sets free at
that moment, busy disk or not (a load's reads still go first: spill_io's ``first``):
they are reads the updates need anyway, and a backward load of the block copies its
master from them instead of reading it ([Note: lent masters]). Only into idle time,
a backward whose disk never idled read nothing ahead after the first layers: the
3.2B shape with every layer kept read 59 GB a step with 24 sets (53.5 with 64, which
the forward's idle moments fill further). When no set is free, or the disk is busy
for the next step's chunks, ``read_ahead`` returns the disk's next landing (a future):
the worker waits for it or for its next job, whichever comes first, and looks again.
Nothing is called back into the worker.

Bound: the plan's ``spill_staging`` staging sets, the chunks read ahead and those in
flight together: at most ``spill_staging`` x spilled kinds x one chunk
(``spill_chunk_numel`` x the kind's element bytes: 4, or 2 for bf16 m and v) of
staged state, all in the spill files' staging pool; this module allocates no
buffer of its own, only the list of the next step's chunks (a few integers per
chunk).
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import time
from typing import NamedTuple, Sequence

from megatrain.plan.buffer_kinds import BufferKind

from megatrain.runtime.device.event_log import EventLog
from megatrain.runtime.spill.spill_files import SpillFiles
from megatrain.runtime.spill.staging_pool import Staged


class Piece(NamedTuple):
    """A chunk of one step's update of a block: elements [lo, lo + n) of block ``block``."""

    step: int
    block: int
    lo: int
    n: int


class ReadAhead:
    """Staging sets for the AdamW worker's chunks, read ahead in the known update order ([Note: spill read-ahead]).

    Used from the worker thread only."""

    def __init__(self, files: SpillFiles, order: Sequence[int], log: EventLog) -> None:
        self.files = files
        self.log = log
        self.order = tuple(order)  # the blocks in the order every step updates them
        self.wait_seconds = 0.0  # cumulative: blocked issuing reads (every staging set still being written back)
        self._step, self._taken = 0, 0  # the step whose jobs are being taken, and how many of them so far
        self._next: collections.deque[Piece] = collections.deque()  # the next step's chunks still to read ahead
        self._ahead: collections.deque[tuple[Piece, int, Staged]] = collections.deque()  # read ahead, files' version
        self._held: list[tuple[int, int]] = []  # (step, block) of the chunks staged for their job, not yet written

    @property
    def depth(self) -> int:
        """Chunks the worker may hold staged at once: the plan's ``spill_staging``."""
        return self.files.staging.count

    def pieces(self, block: int) -> list[tuple[int, int]]:
        """The (first element, elements) pieces an update of ``block`` walks: its spill chunks when something of
        it spills, else the whole block."""
        if not self.files.spilled(block):
            return [(0, self.files.numels[block])]
        return self.files.chunks(block)

    def taken(self, step: int, block: int) -> None:
        """The worker took ``step``'s job of ``block``; once it took all of them, the next step's chunks of the
        blocks that spill, in the known order, are the ones to read ahead, through that step's jobs too."""
        if step != self._step:  # a new step's jobs: the list goes on if it is this step's, else it is stale
            self._step, self._taken = step, 0
            if self._next and self._next[0].step != step:
                self._next.clear()
        self._taken += 1
        if self._taken == len(self.order):
            files = self.files
            self._next = collections.deque(
                Piece(step + 1, b, lo, n) for b in self.order if files.spilled(b) for lo, n in files.chunks(b))

    def read_ahead(self, idle: bool = False) -> cf.Future | None:
        """Read the next step's first chunks' master, m and v ahead into the sets the worker does not hold (up to
        ``depth`` held in all); a chunk whose block still has a chunk held for the step before waits its turn.
        ``idle``: it reads the next step's chunks only into the disk's idle time (``_disk_busy``), so the reads
        of loads and the writes of updates never queue behind a step's worth of reads ahead, and the chunks of
        the step whose jobs are coming into the sets free now, busy disk or not; and where it stopped for the
        busy disk (or, busy, for a set still being written back) it returns the disk's next landing, after which
        to look again. Without ``idle`` it reads as far as the sets allow, waiting for those being written back,
        and returns None."""
        while self._next and len(self._ahead) + len(self._held) < self.depth:
            piece = self._next[0]
            if any(b == piece.block and s != piece.step for s, b in self._held):
                return None
            landing = self._disk_busy() if idle else None
            if landing is not None and piece.step != self._step:  # the next step's chunks: only into idle time
                return landing
            kinds = [k for k in self.files.spilled(piece.block) if k is not BufferKind.GRADS]
            t0 = time.perf_counter()
            version = self.files.version
            staged = self.files.stage(piece.block, piece.lo, piece.n, kinds, wait=landing is None)
            self.wait_seconds += time.perf_counter() - t0
            if staged is None:  # busy, and every set in use or being written back: look again once one lands
                return landing
            self._next.popleft()
            self._ahead.append((piece, version, staged))
            if BufferKind.MASTER in kinds:  # a load of the block for this step may copy it ([Note: lent masters])
                self.files.lent.offer(*piece[:3], staged.buffers[BufferKind.MASTER],
                                      staged.reads[kinds.index(BufferKind.MASTER)], version)
            self.log.record("spill_read", piece.step, piece.block, lo=piece.lo, phase="ahead")
        return None

    def _disk_busy(self) -> cf.Future | None:
        """None when nothing is in flight on the disk (what a load or an update asks for next then waits behind one
        chunk's reads ahead at most); else the disk's next landing (taken before the look, so one that lands
        meanwhile is not missed: its future is done already)."""
        landing = self.files.io_clock.next_landing()
        return None if self.files.io_clock.inflight == 0 else landing

    def stage(self, step: int, block: int, lo: int, n: int, grads: bool) -> Staged | None:
        """Block ``block``'s spilled kinds, elements [lo, lo + n), on their way into a staging set for ``step``'s
        update (the gradients too when ``grads``: they are in their file); None when none of them is on disk.
        The set read ahead for this chunk when it is next in order and the files did not change since, completed
        with the gradients; else a fresh read (waits while every set is being written back)."""
        kinds = [k for k in self.files.spilled(block) if k is not BufferKind.GRADS or grads]
        if not kinds:
            return None
        t0 = time.perf_counter()
        ahead = self._from_ahead(Piece(step, block, lo, n))
        if ahead is not None:  # its master, m and v are read or on their way: add what is left (the gradients)
            staged = self.files.stage_more(block, n, ahead, [k for k in kinds if k not in ahead.buffers])
        else:
            staged = self.files.stage(block, lo, n, kinds)
            self.log.record("spill_read", step, block, lo=lo)
        self.wait_seconds += time.perf_counter() - t0
        self._held.append((step, block))
        return staged

    def write_behind(self, step: int, block: int, n: int, staged: Staged) -> None:
        """The chunk's update is done: write its state back behind; its set returns to the pool once written."""
        self.files.write_behind(block, n, staged)
        self._held.remove((step, block))
        self.log.record("spill_write", step, block, lo=staged.lo)

    def drop(self) -> None:
        """Discard every set read ahead (their reads land first) and forget the chunks still to read ahead."""
        while self._ahead:
            piece, _, staged = self._ahead.popleft()
            self.files.lent.withdraw(*piece[:3])
            self.files.discard(staged)
            self.log.record("spill_discard", piece.step, piece.block, lo=piece.lo)
        self._next.clear()

    def _from_ahead(self, piece: Piece) -> Staged | None:
        """The set read ahead for ``piece`` if it is the next one read ahead and the files' version is the same;
        otherwise every set read ahead is dropped (a chunk out of the known order) and None."""
        if not self._ahead:  # nothing read ahead: the chunk is read now; a chunk of the list's step is its next
            if self._next and self._next[0].step == piece.step:
                if self._next[0] == piece:
                    self._next.popleft()
                else:  # out of the known order
                    self._next.clear()
            return None
        first, version, staged = self._ahead[0]
        if first == piece and version == self.files.version:
            self._ahead.popleft()
            self.files.lent.withdraw(*piece[:3])  # its update changes the master in place
            return staged
        self.drop()
        return None
