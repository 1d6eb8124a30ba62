"""Masters the AdamW worker read ahead, lent to the loader thread, so a load does not read them from disk again.

[Note: lent masters]
The read-ahead ([Note: spill read-ahead] in read_ahead.py) stages the master, m and v of
chunk (step s, block b) before the block's update for step s. The master it holds is
the block's as updated for step s - 1: what a load of the block for step s reads
([Note: spilled loads] in spilled_loads.py), forward or backward, both before that
update. So the read-ahead offers each master chunk it stages (``offer``), and a load
for step s copies an offered chunk of (s, b) once its read has landed, instead of
reading it from the file (``copy``). The worker withdraws a chunk (``withdraw``)
before it takes the set for the update, which changes the master in place, or drops
it; a withdraw waits for a copy in progress. A chunk offered under another
``SpillFiles.version`` (a cold-path write since) is not lent. No race is left for
the entry a load needs: the update of (s, b) is taken only after the block's
backward, which waits for its load.

Eager mode: the read-ahead runs through the step in update order (the head, the
layers in reverse, the embedding), the order of backward's loads, so a backward load
finds its block's master staged where the sets reach (a spilled fp32 3.2B step
without clipping read 7-8 GB less of its 62-67 GB with 24 staging sets, 14 GB less
with 64). Deferred mode: only the next update's first blocks (forward order), which
backward loads last.

Bound: an entry per chunk read ahead, at most the plan's ``spill_staging``; no buffer
of its own. Threads: one condition variable; a copy marks its entry busy and copies
outside the lock.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
from dataclasses import dataclass

import torch


@dataclass
class _Lent:
    buffer: torch.Tensor  # the staging set's master buffer (fp32, the chunk's elements first)
    read: cf.Future  # its read from the master file
    version: int  # the files' version when the read was issued
    busy: int = 0  # copies in progress


class LentMasters:
    """Master chunks read ahead for their update, keyed by (step, block, first element): [Note: lent masters]."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._lent: dict[tuple[int, int, int], _Lent] = {}
        self.copies = 0  # cumulative: chunks loads copied instead of reading them

    def offer(self, step: int, block: int, lo: int, buffer: torch.Tensor, read: cf.Future, version: int) -> None:
        """The worker staged (step, block)'s master chunk at ``lo`` into ``buffer`` (``read`` lands it)."""
        with self._cond:
            self._lent[(step, block, lo)] = _Lent(buffer, read, version)

    def withdraw(self, step: int, block: int, lo: int) -> None:
        """The worker takes the chunk back (to update it in place, or to drop it): no copy may start from it, and
        one in progress finishes first."""
        with self._cond:
            entry = self._lent.pop((step, block, lo), None)
            while entry is not None and entry.busy:
                self._cond.wait()

    def copy(self, step: int, block: int, lo: int, out: torch.Tensor, version: int) -> bool:
        """A load for ``step``: block ``block``'s master elements [lo, lo + out.numel()) into ``out`` from the chunk
        offered for that step, once read; False (nothing copied) when none is offered under this ``version`` or its
        read failed (the caller reads the file)."""
        with self._cond:
            entry = self._lent.get((step, block, lo))
            if entry is None or entry.version != version:
                return False
            entry.busy += 1
        try:
            failed = entry.read.exception() is not None
            if not failed:
                out.copy_(entry.buffer[:out.numel()])
        finally:
            with self._cond:
                entry.busy -= 1
                self._cond.notify_all()
        if failed:
            return False
        self.copies += 1  # (the loader thread's alone)
        return True
