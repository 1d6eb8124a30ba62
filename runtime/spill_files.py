"""Spill files: the fp32 kinds a plan keeps on disk instead of RAM, the order of their writes, and the
staging sets through which CPU AdamW reads a block's spilled state ahead and writes it back behind.

[Note: spill]
With a spill plan, some fp32 kinds live in preallocated spill files instead of
host RAM (``optimizer``: m and v; ``all``: master, m, v and the deferred-mode
gradients; ``buffer_kinds.spilled_kinds`` is the rule), one file per kind, each
block at a fixed offset rounded up to ``SPILL_ALIGN`` (4 KiB, for O_DIRECT).
The files live in a directory named after this process (``spill_dirs``) and go
with it. They are touched only through staging sets (``StagingPool``): AdamW
reads a block's spilled state into one, updates it there, and writes it back
behind; ``read_block`` / ``write_block`` serve the cold paths (init, state
dicts, checkpoints). A block's reads wait for its previous writes (the last
write of each (kind, block) is remembered). The compute-dtype shadow (what
travels H2D) always stays in RAM; in fp32 with a spilled master it is an fp32
copy in RAM.

[Note: spill pipeline]
The AdamW worker keeps up to ``spill_staging`` jobs in flight: for each queued
job it takes a staging set and issues the reads of the block's spilled state
ahead (``stage``), updates the oldest once its reads land, and writes its state
back behind (``write_behind``); a staging set returns to the pool when its
writes finish. Without spill there is one job in flight and no I/O.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import shutil
import threading
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import torch

from megatrain.planner.buffer_kinds import STATE_KINDS, BufferKind, spill_block_bytes

from . import spill_dirs
from .spill_io import FileIO, SpillSpaceError, aligned_empty

if TYPE_CHECKING:
    from .streams import Event


class StagingPool:
    """Bounded sets of aligned fp32 host buffers between spill files and CPU AdamW.

    Bound: ``count`` sets x spilled kinds x largest block (rounded up to 4 KiB) x 4 bytes.
    """

    def __init__(self, count: int, kinds: Sequence[BufferKind], block_bytes: int) -> None:
        self._sets = [{k: aligned_empty(block_bytes).view(torch.float32) for k in kinds} for _ in range(count)]
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(count):
            self._free.put(i)

    @property
    def count(self) -> int:
        return len(self._sets)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * 4 for s in self._sets for t in s.values())

    def acquire(self) -> int:
        return self._free.get()

    def buffers(self, index: int) -> dict[BufferKind, torch.Tensor]:
        return self._sets[index]

    def release(self, index: int) -> None:
        self._free.put_nowait(index)


class Staged(NamedTuple):
    """One block's spilled state on its way into a staging set (see [Note: spill pipeline])."""

    index: int  # the staging set
    buffers: dict[BufferKind, torch.Tensor]  # its buffers, one per spilled kind
    reads: list[cf.Future]  # the reads issued ahead into them


class SpillFiles:
    """One preallocated file per spilled kind, each block at a fixed aligned offset; the staging pool."""

    def __init__(self, numels: Sequence[int], kinds: Sequence[BufferKind], spill_dir: str, io: FileIO,
                 staging: int) -> None:
        self.kinds = tuple(kinds)
        self.numels = list(numels)
        self.io: FileIO | None = io
        self.block_bytes = [spill_block_bytes(n) for n in numels]
        self.file_offsets, at = [], 0
        for nbytes in self.block_bytes:
            self.file_offsets.append(at)
            at += nbytes
        self.file_bytes = at
        self.files: dict[BufferKind, int] = {}
        # Writes that must wait for a D2H drain first run from here, so no caller blocks on the GPU.
        self._after_pool: cf.ThreadPoolExecutor | None = None
        self._writes: dict[tuple[BufferKind, int], cf.Future] = {}  # last write of each (kind, block)
        self._writes_lock = threading.Lock()
        self.root: str | None = None
        try:
            self.root = spill_dirs.create(spill_dir)  # named after this process; dead owners' ones reclaimed
            free = shutil.disk_usage(self.root).free
            if self.nbytes > free:  # the total, before any file takes its share
                raise _no_space(spill_dir, self.kinds, self.nbytes, free)
            for kind in self.kinds:
                self.files[kind] = io.open(os.path.join(self.root, f"{kind}.bin"), at)
        except SpillSpaceError:
            self.close()
            raise _no_space(spill_dir, self.kinds, self.nbytes, shutil.disk_usage(spill_dir).free) from None
        except BaseException:
            self.close()
            raise
        self.staging = StagingPool(staging, self.kinds, max(self.block_bytes))

    @property
    def nbytes(self) -> int:
        """Bytes on disk: every spilled kind's file."""
        return len(self.kinds) * self.file_bytes

    # ---- transfers and their order ---------------------------------------------------------
    def _view(self, b: int, t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8)[:self.block_bytes[b]]

    def read_async(self, kind: BufferKind, b: int, out: torch.Tensor) -> cf.Future:
        """Block b's ``kind`` into ``out`` (fp32, >= block bytes), after its previous write."""
        self.wait_write(kind, b)
        assert self.io is not None
        return self.io.read(self.files[kind], self.file_offsets[b], self._view(b, out))

    def write_async(self, kind: BufferKind, b: int, src: torch.Tensor) -> cf.Future:
        """Write ``src`` (fp32, >= block bytes) as block b's ``kind``; later reads of it wait for this."""
        assert self.io is not None
        future = self.io.write(self.files[kind], self.file_offsets[b], self._view(b, src))
        with self._writes_lock:
            self._writes[(kind, b)] = future
        return future

    def write_after(self, kind: BufferKind, b: int, src: torch.Tensor, ready: "Event",
                    then: Callable[[], None]) -> None:
        """Write ``src`` (>= block bytes) as block b's ``kind`` once ``ready`` (a D2H drain) has happened.

        Registered at once, so a later read of the block waits for it; ``then`` runs when it is done.
        """
        placeholder: cf.Future = cf.Future()
        with self._writes_lock:
            self._writes[(kind, b)] = placeholder
        if self._after_pool is None:
            self._after_pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-drain-write")
        io, handle, offset, view = self.io, self.files[kind], self.file_offsets[b], self._view(b, src)
        assert io is not None

        def run() -> None:
            try:
                ready.synchronize()
                io.write(handle, offset, view).result()
                placeholder.set_result(None)
            except BaseException as e:
                placeholder.set_exception(e)
            finally:
                then()
        self._after_pool.submit(run)

    def wait_write(self, kind: BufferKind, b: int) -> None:
        with self._writes_lock:
            future = self._writes.get((kind, b))
        if future is not None:
            future.result()

    def flush(self) -> None:
        """Wait for every write behind (raises the first I/O error)."""
        with self._writes_lock:
            futures = list(self._writes.values())
        for f in futures:
            f.result()

    # ---- cold paths: one block at a time, synchronously ------------------------------------
    def read_block(self, kind: BufferKind, b: int) -> torch.Tensor:
        """A copy of block b's ``kind`` ([numel] fp32), read from its file."""
        buf = aligned_empty(self.block_bytes[b]).view(torch.float32)
        self.read_async(kind, b, buf).result()
        return buf[:self.numels[b]]

    def write_block(self, kind: BufferKind, b: int, src: torch.Tensor) -> None:
        """Store ``src`` ([numel] fp32) as block b's ``kind``, synchronously."""
        buf = aligned_empty(self.block_bytes[b]).view(torch.float32)
        buf.zero_()
        buf[:self.numels[b]].copy_(src)
        self.write_async(kind, b, buf).result()

    # ---- the AdamW pipeline (see [Note: spill pipeline]) -----------------------------------
    def stage(self, b: int, kinds: Sequence[BufferKind]) -> Staged:
        """Take a staging set (waits while every set is still being written back) and read block b's
        ``kinds`` into it ahead."""
        index = self.staging.acquire()
        buffers = self.staging.buffers(index)
        return Staged(index, buffers, [self.read_async(k, b, buffers[k]) for k in kinds])

    def write_behind(self, b: int, staged: Staged) -> None:
        """Write block b's updated state (the state kinds among the staged ones) back; the staging set
        returns to the pool once every write has landed."""
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
            self.write_async(kind, b, staged.buffers[kind]).add_done_callback(written)

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
