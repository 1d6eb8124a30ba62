"""Spill files: the kinds a plan keeps on disk instead of RAM, the order of their writes, and the staging sets
through which CPU AdamW reads a block's spilled state and writes it back behind.

[Note: spill]
With a spill plan, some blocks of some kinds live in preallocated spill
files instead of host RAM (``optimizer``: m and v of every block; ``all``:
master, m, v and the deferred-mode gradients; ``blocks``: per kind, the blocks
the plan names; ``buffer_kinds.placement`` is the rule), one file per kind that
has a spilled block, holding only those blocks, each at a fixed offset rounded
up to ``SPILL_ALIGN`` (4 KiB, for O_DIRECT). Each file holds its kind in the
kind's dtype, as RAM would: fp32, but m and v in bf16 (2 bytes per element)
with ``OptimizerConfig(state_dtype="bf16")`` ([Note: bf16 optimizer state]);
offsets, spans and staging buffers are in that kind's bytes, while a block's
chunks are the same element ranges for all its kinds.
The files live in a directory named after this process (``spill_dirs``) and go
with it. They are touched only through staging sets (``StagingPool``): AdamW
reads a block's spilled state into one, updates it there, and writes it back
behind; ``read_block`` / ``write_block`` serve the cold paths (init, state
dicts, checkpoints). The unit of the staging sets' I/O is a chunk of at most
``spill_chunk_bytes`` of fp32 (``buffer_kinds.spill_chunks``), so every staging buffer
is bounded by one chunk, not by the largest block; with bf16 m or v on disk the
chunk is a multiple of 4 MiB (``buffer_kinds.spill_chunk_multiple``), so AdamW
rounds a spilled block in the same pieces as one in RAM. A block's reads wait for its
pending writes (every unfinished write of each (kind, block) is remembered). A
bf16 compute-dtype shadow (what travels H2D) stays in RAM; in fp32 a block
whose master is spilled has none, and its loads read the master file, but for the
chunks an update writes behind while a load taps the block (``tap_master``: copied into
the load's slot on the way; [Note: spilled loads] in spilled_loads.py).

[Note: spill pipeline]
CPU AdamW reads a chunk's spilled kinds into a staging set (``stage``; the block's
kinds in RAM are updated in place), updates it there, and writes it back behind
(``write_behind``); a staging set returns to the pool when its writes finish. A set
staged ahead without the gradients is completed with them (``stage_more``) or, unused,
returned (``discard``); ``version`` moves with every cold-path write, so a read
issued ahead under another value is known to be stale. Which chunks are staged
when, across the step boundary too, is read_ahead.py's ([Note: spill read-ahead]).
Without spill there is one job in flight and no I/O.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import threading
from typing import TYPE_CHECKING, Sequence

import torch

from megatrain.plan.buffer_kinds import (MOMENT_KINDS, STATE_KINDS, BufferKind, Placement, spill_block_bytes,
                                         spill_chunk_numel, spill_chunks)

from megatrain.runtime.spill import spill_dirs
from megatrain.runtime.spill.busy_clock import BusyClock
from megatrain.runtime.spill.lent_masters import LentMasters
from megatrain.runtime.spill.staging_pool import Staged, StagingPool
from megatrain.runtime.spill.spill_io import FileIO, SpillSpaceError, aligned_empty

if TYPE_CHECKING:
    from megatrain.runtime.device.streams import Event


class SpillFiles:
    """One preallocated file per kind with a spilled block, each of its spilled blocks at a fixed aligned offset;
    the staging pool. ``state_dtype``: m and v's, in their files and staging buffers (the other kinds fp32)."""

    def __init__(self, numels: Sequence[int], placement: Placement, spill_dir: str, io: FileIO,
                 staging: int, chunk_bytes: int, state_dtype: torch.dtype = torch.float32) -> None:
        self.kinds = tuple(k for k in BufferKind if placement.get(k))
        self.numels = list(numels)
        self.chunk_bytes = chunk_bytes
        self.io: FileIO | None = io
        # Per kind, its dtype and bytes per element (``buffer_kinds.element_bytes``): m and v in the state dtype.
        self.dtypes = {k: state_dtype if k in MOMENT_KINDS else torch.float32 for k in self.kinds}
        self.element = {k: dt.itemsize for k, dt in self.dtypes.items()}
        # Per kind, each spilled block's byte offset in the kind's file, and the file's size.
        self.file_offsets: dict[BufferKind, dict[int, int]] = {}
        self.file_bytes: dict[BufferKind, int] = {}
        for kind in self.kinds:
            offsets, at = {}, 0
            for b in sorted(placement[kind]):
                offsets[b], at = at, at + self.block_bytes(kind, b)
            self.file_offsets[kind], self.file_bytes[kind] = offsets, at
        self.files: dict[BufferKind, int] = {}
        # Writes that must wait for a D2H drain first run from here, so no caller blocks on the GPU.
        self._after_pool: cf.ThreadPoolExecutor | None = None
        self._writes: dict[tuple[BufferKind, int], list[cf.Future]] = {}  # pending writes of each (kind, block)
        self._writes_lock = threading.Lock()
        # Busy time of the disk: reads, writes, and either (the disk's share of the roofline).
        self.read_clock, self.write_clock, self.io_clock = BusyClock(), BusyClock(), BusyClock()
        # Bumped when a cold-path write (``write_block``: init, state dicts, checkpoints) begins and when it ends:
        # a read issued ahead under another value may hold bytes it replaced.
        self.version = 0
        # Per block, a load's master tap: the slot range its update's master chunks are copied into as they are
        # written behind, and the chunks copied so far ([Note: spilled loads] in spilled_loads.py).
        self._taps: dict[int, tuple[torch.Tensor, set[int]]] = {}
        self._taps_lock = threading.Lock()
        self.lent = LentMasters()  # master chunks read ahead, lent to loads ([Note: lent masters])
        self.root: str | None = None
        try:
            self.root = spill_dirs.create(spill_dir)  # named after this process; dead owners' ones reclaimed
            free = shutil.disk_usage(self.root).free
            if self.nbytes > free:  # the total, before any file takes its share
                raise _no_space(spill_dir, self.kinds, self.nbytes, free)
            for kind in self.kinds:
                self.files[kind] = io.open(os.path.join(self.root, f"{kind}.bin"), self.file_bytes[kind])
        except SpillSpaceError:
            self.close()
            raise _no_space(spill_dir, self.kinds, self.nbytes, shutil.disk_usage(spill_dir).free) from None
        except BaseException:
            self.close()
            raise
        self.chunk_numel = spill_chunk_numel(max(self.numels), chunk_bytes)
        self.staging = StagingPool(staging, self.dtypes, self.chunk_numel)

    @property
    def nbytes(self) -> int:
        """Bytes on disk: every spilled kind's file (its spilled blocks, each rounded up to SPILL_ALIGN)."""
        return sum(self.file_bytes.values())

    def block_bytes(self, kind: BufferKind, b: int) -> int:
        """Bytes block b's ``kind`` takes in its file: numel x the kind's element bytes, rounded up to SPILL_ALIGN."""
        return spill_block_bytes(self.numels[b], self.element[kind])

    def spilled(self, b: int) -> tuple[BufferKind, ...]:
        """The kinds of block b that live in spill files."""
        return tuple(k for k in self.kinds if b in self.file_offsets[k])

    # ---- transfers and their order ---------------------------------------------------------
    def chunks(self, b: int) -> list[tuple[int, int]]:
        """Block b's (first element, elements) pieces: the unit of the AdamW pipeline's I/O."""
        return spill_chunks(self.numels[b], self.chunk_bytes)

    def _span(self, kind: BufferKind, b: int, lo: int, n: int) -> int:
        """Bytes a transfer of block b's ``kind`` elements [lo, lo + n) moves: rounded up to SPILL_ALIGN, within
        the block's (aligned) extent in the file."""
        e = self.element[kind]
        return min(spill_block_bytes(n, e), self.block_bytes(kind, b) - lo * e)

    def _offset(self, kind: BufferKind, b: int, lo: int) -> int:
        """The file offset of block b's ``kind`` element ``lo``."""
        return self.file_offsets[kind][b] + lo * self.element[kind]

    def read_async(self, kind: BufferKind, b: int, out: torch.Tensor, lo: int = 0, n: int | None = None,
                   exact: bool = False, first: bool = False) -> cf.Future:
        """Block b's ``kind`` elements [lo, lo + n) (default: the whole block) into ``out`` (the kind's dtype),
        after the block's pending writes. ``out`` holds the 4 KiB-rounded span, or, ``exact``, just n elements;
        ``first``: a load's read, before the transfers queued (``FileIO.read``)."""
        n = self.numels[b] - lo if n is None else n
        self.wait_write(kind, b)
        assert self.io is not None and out.dtype == self.dtypes[kind]
        nbytes = n * self.element[kind] if exact else self._span(kind, b, lo, n)
        return self._timed(self.read_clock, self.io.read(self.files[kind], self._offset(kind, b, lo),
                                                         out.view(torch.uint8)[:nbytes], first))

    def _timed(self, clock: BusyClock, future: cf.Future) -> cf.Future:
        return self.io_clock.track(clock.track(future))

    def write_async(self, kind: BufferKind, b: int, src: torch.Tensor, lo: int = 0, n: int | None = None) -> cf.Future:
        """Write ``src`` (the kind's dtype, >= the 4 KiB-rounded span) as block b's ``kind`` elements [lo, lo + n)
        (default: the whole block); later reads of the block wait for this."""
        n = self.numels[b] - lo if n is None else n
        assert self.io is not None and src.dtype == self.dtypes[kind]
        future = self._timed(self.write_clock, self.io.write(self.files[kind], self._offset(kind, b, lo),
                                                             src.view(torch.uint8)[:self._span(kind, b, lo, n)]))
        self._register(kind, b, future)
        return future

    def _register(self, kind: BufferKind, b: int, future: cf.Future) -> None:
        with self._writes_lock:
            pending = [f for f in self._writes.get((kind, b), ()) if not f.done()]
            pending.append(future)
            self._writes[(kind, b)] = pending

    def write_after(self, kind: BufferKind, b: int, src: torch.Tensor, ready: "Event", lo: int = 0,
                    n: int | None = None) -> cf.Future:
        """Write ``src`` as block b's ``kind`` elements [lo, lo + n) once ``ready`` (a D2H drain) has happened.

        Registered at once, so a later read of the block waits for it; the future is done when it is written (or
        failed): the caller decides what follows (``src`` free to reuse).
        """
        n = self.numels[b] - lo if n is None else n
        placeholder: cf.Future = cf.Future()
        self._register(kind, b, placeholder)
        if self._after_pool is None:
            self._after_pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-drain-write")
        io, handle, offset = self.io, self.files[kind], self._offset(kind, b, lo)
        view = src.view(torch.uint8)[:self._span(kind, b, lo, n)]
        assert io is not None and src.dtype == self.dtypes[kind]

        def run() -> None:
            try:
                ready.synchronize()
                self._timed(self.write_clock, io.write(handle, offset, view)).result()
                placeholder.set_result(None)
            except BaseException as e:
                placeholder.set_exception(e)
        self._after_pool.submit(run)
        return placeholder

    def wait_write(self, kind: BufferKind, b: int) -> None:
        with self._writes_lock:
            futures = list(self._writes.get((kind, b), ()))
        for future in futures:
            future.result()

    def flush(self) -> None:
        """Wait for every write behind (raises the first I/O error)."""
        with self._writes_lock:
            futures = [f for fs in self._writes.values() for f in fs]
        for f in futures:
            f.result()

    # ---- cold paths: one block at a time, synchronously ------------------------------------
    def read_block(self, kind: BufferKind, b: int) -> torch.Tensor:
        """A copy of block b's ``kind`` ([numel], the kind's dtype), read from its file in chunks, all in flight
        at once."""
        buf = aligned_empty(self.block_bytes(kind, b)).view(self.dtypes[kind])
        for f in [self.read_async(kind, b, buf[lo:], lo, n) for lo, n in self.chunks(b)]:
            f.result()
        return buf[:self.numels[b]]

    def write_block(self, kind: BufferKind, b: int, src: torch.Tensor) -> None:
        """Store ``src`` ([numel], converted to the kind's dtype) as block b's ``kind``: chunk writes all in flight
        at once (large requests on every I/O thread: init writes the masters at the disk's speed), waited for."""
        buf = aligned_empty(self.block_bytes(kind, b)).view(self.dtypes[kind])
        buf[self.numels[b]:].zero_()
        buf[:self.numels[b]].copy_(src)
        self.version += 1
        try:
            for f in [self.write_async(kind, b, buf[lo:], lo, n) for lo, n in self.chunks(b)]:
                f.result()
        finally:
            self.version += 1

    # ---- the AdamW pipeline (see [Note: spill pipeline]) -----------------------------------
    def stage(self, b: int, lo: int, n: int, kinds: Sequence[BufferKind], wait: bool = True) -> Staged | None:
        """Take a staging set (waits while every set is still being written back; None then without ``wait``)
        and read block b's ``kinds`` (spilled ones of this block), elements [lo, lo + n), into it ahead."""
        index = self.staging.acquire() if wait else self.staging.try_acquire()
        if index is None:
            return None
        buffers = {k: self.staging.buffers(index)[k] for k in kinds}
        return Staged(index, lo, buffers, [self.read_async(k, b, buffers[k], lo, n) for k in kinds])

    def stage_more(self, b: int, n: int, staged: Staged, kinds: Sequence[BufferKind]) -> Staged:
        """A set staged ahead with some kinds (read_ahead.py), completed with the reads of ``kinds`` (e.g. the
        gradients, written since) into the same set."""
        more = {k: self.staging.buffers(staged.index)[k] for k in kinds}
        return Staged(staged.index, staged.lo, {**staged.buffers, **more},
                      staged.reads + [self.read_async(k, b, more[k], staged.lo, n) for k in kinds])

    def discard(self, staged: Staged) -> None:
        """Drop a set staged ahead and never used: its reads land (an error in them no longer matters), the set
        returns to the pool."""
        cf.wait(staged.reads)
        self.staging.release(staged.index)

    def tap_master(self, b: int, out: torch.Tensor) -> None:
        """Until ``untap(b)``: each chunk of block b's master written behind (an update's, ``write_behind``) is
        copied into ``out`` (fp32, the block's elements) too, so a load of the block need not read it back."""
        with self._taps_lock:
            assert b not in self._taps, f"block {b}'s master is tapped already"
            self._taps[b] = (out, set())

    def untap(self, b: int) -> set[int]:
        """End block b's tap; the first elements of the chunks it copied."""
        with self._taps_lock:
            return self._taps.pop(b)[1]

    def write_behind(self, b: int, n: int, staged: Staged) -> None:
        """Write the chunk's updated state (the state kinds among the staged ones) back, its master first copied
        into a tap on the block if there is one; the staging set returns to the pool once every write has
        landed."""
        master = staged.buffers.get(BufferKind.MASTER)
        if master is not None:
            with self._taps_lock:  # before the writes: the set may be reused once they land
                tap = self._taps.get(b)
                if tap is not None:
                    tap[0][staged.lo:staged.lo + n].copy_(master[:n])
                    tap[1].add(staged.lo)
        kinds = [k for k in STATE_KINDS if k in staged.buffers]
        if not kinds:
            self.staging.release(staged.index)
            return
        pending = [len(kinds)]
        lock = threading.Lock()

        def written(_: cf.Future) -> None:
            with lock:
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                self.staging.release(staged.index)

        for kind in kinds:
            self.write_async(kind, b, staged.buffers[kind], staged.lo, n).add_done_callback(written)

    def close(self) -> None:
        if self._after_pool is not None:
            self._after_pool.shutdown(wait=True)
            self._after_pool = None
        if self.io is not None:
            self.io.close()
            self.io = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


def _no_space(spill_dir: str, kinds: Sequence[BufferKind], need: int, free: int) -> SpillSpaceError:
    return SpillSpaceError(f"the spill files ({', '.join(f'{k}.bin' for k in kinds)}) need {_size(need)} in all but "
                           f"{spill_dir} has {_size(free)} free; free space, choose another "
                           "spill_dir, or spill less")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
