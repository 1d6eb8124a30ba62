"""The staging sets between spill files and CPU AdamW, and one chunk staged in one of them."""
from __future__ import annotations

import concurrent.futures as cf
import queue
from typing import Mapping, NamedTuple

import torch

from megatrain.plan.buffer_kinds import BufferKind, spill_block_bytes

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

    @property
    def count(self) -> int:
        return len(self._sets)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self._sets for t in s.values())

    def acquire(self) -> int:
        return self._free.get()

    def try_acquire(self) -> int | None:
        """A set free now, or None (every set is in use or being written back)."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            return None

    def buffers(self, index: int) -> dict[BufferKind, torch.Tensor]:
        return self._sets[index]

    def release(self, index: int) -> None:
        self._free.put_nowait(index)


class Staged(NamedTuple):
    """One chunk of a block's spilled state on its way into a staging set (see [Note: spill pipeline])."""

    index: int  # the staging set
    lo: int  # the chunk's first element in its block
    buffers: dict[BufferKind, torch.Tensor]  # its buffers, one per kind of the block read from its file (its dtype)
    reads: list[cf.Future]  # the reads issued ahead into them
