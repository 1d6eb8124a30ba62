"""The staging sets between spill files and CPU AdamW, and one chunk staged in one of them."""
from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
from typing import Callable, Mapping, NamedTuple

import torch

from megatrain.planner.buffer_kinds import BufferKind, spill_block_bytes

from megatrain.runtime.spill.spill_io import aligned_empty


class StagingPool:
    """Bounded sets of aligned host buffers, one per spilled kind in its dtype, between spill files and CPU AdamW.

    Bound: ``count`` sets x the sum over spilled kinds of one chunk (``spill_chunk_numel`` elements: min(plan
    chunk, largest block rounded up to 4 KiB) / 4) x the kind's element bytes, rounded up to 4 KiB; never the
    largest block when that is larger than a chunk.
    """

    def __init__(self, count: int, dtypes: Mapping[BufferKind, torch.dtype], chunk_numel: int) -> None:
        self._sets = [{k: aligned_empty(spill_block_bytes(chunk_numel, dt.itemsize)).view(dt)
                       for k, dt in dtypes.items()} for _ in range(count)]
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(count):
            self._free.put(i)
        self._lock = threading.Lock()  # a non-waiting acquire and a release: no wake-up lost between them
        self._wake: Callable[[], None] | None = None

    @property
    def count(self) -> int:
        return len(self._sets)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self._sets for t in s.values())

    def acquire(self, wake: Callable[[], None] | None = None) -> int | None:
        """A free set's index, waiting for one; with ``wake``, None at once when none is free, and ``wake`` is
        called (once, from the thread that gives a set back) when one is."""
        if wake is None:
            return self._free.get()
        with self._lock:
            try:
                return self._free.get_nowait()
            except queue.Empty:
                self._wake = wake
                return None

    def buffers(self, index: int) -> dict[BufferKind, torch.Tensor]:
        return self._sets[index]

    def release(self, index: int) -> None:
        with self._lock:
            self._free.put_nowait(index)
            wake, self._wake = self._wake, None
        if wake is not None:
            wake()


class Staged(NamedTuple):
    """One chunk of a block's spilled state on its way into a staging set (see [Note: spill pipeline])."""

    index: int  # the staging set
    lo: int  # the chunk's first element in its block
    buffers: dict[BufferKind, torch.Tensor]  # its buffers, one per kind of the block read from its file (its dtype)
    reads: list[cf.Future]  # the reads issued ahead into them
