"""The state a plan keeps on disk, behind one face: every read and write of the spill files goes through here.

[Note: one face of spilled state]
The spill files (spill_files.py) hold the (block, kind) pairs a plan spills. Three parts of the step reach them:

- the host store: its cold paths (``read_block`` / ``write_block``: init, state dicts, checkpoints), and a
  spilled gradient's chunks, each written behind its D2H drain (``write_grads``);
- the AdamW worker: each chunk's master, m, v (and gradient) staged for its update and written back behind, read
  ahead in the step's update order (``read_ahead`` builds its read-ahead, [Note: spill read-ahead]);
- a load of a block whose fp32 master spills ([Note: spilled loads] in runtime/pipeline/spilled_loads.py): the
  master tapped while its update writes it behind (``tap_master`` / ``untap``), its chunks read before the
  transfers queued for AdamW or copied from a chunk the read-ahead staged (``read_master``), and, data parallel,
  a wait for the update's master writes (``wait_master_written``).

Nothing else holds the files: the gradients and the optimizer state reach the disk through this object, which
also gives the disk's busy seconds (``busy_seconds``, [Note: roofline]). What it owns beyond the files: nothing
(the staging sets and the lent masters are the files').
"""
from __future__ import annotations

import concurrent.futures as cf
from typing import TYPE_CHECKING, Sequence

import torch

from megatrain.plan.buffer_kinds import BufferKind, Placement

from megatrain.runtime.device.event_log import EventLog
from megatrain.runtime.spill.read_ahead import ReadAhead
from megatrain.runtime.spill.spill_files import SpillFiles
from megatrain.runtime.spill.spill_io import FileIO
from megatrain.runtime.spill.staging_pool import StagingPool

if TYPE_CHECKING:
    from megatrain.runtime.device.streams import Event


class SpilledState:
    """The spill files of a plan and every way to them ([Note: one face of spilled state])."""

    def __init__(self, numels: Sequence[int], placement: Placement, spill_dir: str, io: FileIO,
                 staging: int, chunk_bytes: int, state_dtype: torch.dtype = torch.float32) -> None:
        """As ``SpillFiles``: the blocks' elements, the (kind -> blocks) on disk, the folder, the I/O backend, the
        plan's staging sets and chunk, m and v's dtype."""
        self._files = SpillFiles(numels, placement, spill_dir, io, staging, chunk_bytes, state_dtype)

    # ---- what is on disk ------------------------------------------------------------------
    def spilled(self, b: int) -> tuple[BufferKind, ...]:
        """The kinds of block b that live in spill files."""
        return self._files.spilled(b)

    def chunks(self, b: int) -> list[tuple[int, int]]:
        """Block b's (first element, elements) pieces: the unit of every transfer but the cold paths'."""
        return self._files.chunks(b)

    @property
    def chunk_numel(self) -> int:
        """Elements of the largest chunk (``buffer_kinds.spill_chunk_numel``)."""
        return self._files.chunk_numel

    @property
    def nbytes(self) -> int:
        """Bytes on disk: every spilled kind's file."""
        return self._files.nbytes

    @property
    def file_bytes(self) -> dict[BufferKind, int]:
        """Each spilled kind's file size."""
        return dict(self._files.file_bytes)

    @property
    def root(self) -> str | None:
        """The folder of the files (named after this process); None once closed."""
        return self._files.root

    @property
    def staging(self) -> StagingPool:
        """The staging sets AdamW's chunks pass through (their bytes are host RAM the planner counts)."""
        return self._files.staging

    @property
    def io(self) -> FileIO | None:
        """The I/O backend (None once closed)."""
        return self._files.io

    @property
    def lent_copies(self) -> int:
        """Cumulative: master chunks loads copied from the read-ahead instead of reading them ([Note: lent
        masters])."""
        return self._files.lent.copies

    def busy_seconds(self) -> dict[str, float]:
        """Cumulative seconds a read, a write, or either was in flight on the disk ([Note: roofline])."""
        files = self._files
        return {"disk_read_busy_s": files.read_clock.seconds, "disk_write_busy_s": files.write_clock.seconds,
                "disk_busy_s": files.io_clock.seconds}

    # ---- the host store: cold paths and the gradients -------------------------------------
    def read_block(self, kind: BufferKind, b: int) -> torch.Tensor:
        """A copy of block b's ``kind`` ([numel], the kind's dtype), read whole."""
        return self._files.read_block(kind, b)

    def write_block(self, kind: BufferKind, b: int, src: torch.Tensor) -> None:
        """Store ``src`` ([numel]) as block b's ``kind``, waited for (a read ahead of the old bytes is stale)."""
        self._files.write_block(kind, b, src)

    def write_grads(self, b: int, src: torch.Tensor, drained: "Event", lo: int, n: int) -> cf.Future:
        """Block b's gradient elements [lo, lo + n) from ``src`` (fp32, 4 KiB-rounded) to the grads file once
        ``drained`` (their D2H copy) has happened; AdamW's read of them waits for it. Done once written: ``src``
        may be reused (its slab given back)."""
        return self._files.write_after(BufferKind.GRADS, b, src, drained, lo, n)

    def flush(self) -> None:
        """Wait for every write behind (raises the first I/O error)."""
        self._files.flush()

    def close(self) -> None:
        """Stop the I/O, delete the files and their folder."""
        self._files.close()

    # ---- the AdamW worker ------------------------------------------------------------------
    def read_ahead(self, order: Sequence[int], log: EventLog) -> ReadAhead:
        """The AdamW worker's staging of each chunk, read ahead in ``order`` (the blocks as every step updates
        them), and its writes behind ([Note: spill read-ahead])."""
        return ReadAhead(self._files, order, log)

    # ---- the loads of spilled fp32 masters ---------------------------------------------------
    def tap_master(self, b: int, out: torch.Tensor) -> None:
        """Until ``untap(b)``: each chunk of block b's master an update writes behind is copied into ``out`` too."""
        self._files.tap_master(b, out)

    def untap(self, b: int) -> set[int]:
        """End block b's tap; the first elements of the chunks it copied."""
        return self._files.untap(b)

    def read_master(self, b: int, out: torch.Tensor, lo: int, n: int, step: int | None,
                    exact: bool = True) -> cf.Future | None:
        """A load's read of block b's master elements [lo, lo + n) into ``out``: copied at once from the chunk the
        read-ahead staged for ``step``'s update when it lent one (None returned: [Note: lent masters]), else read
        from the file after the block's pending master writes, before the transfers queued for AdamW (the
        read's future). ``exact``: ``out`` holds just n elements, else the 4 KiB-rounded span."""
        files = self._files
        if step is not None and files.lent.copy(step, b, lo, out[:n], files.version):
            return None
        return files.read_async(BufferKind.MASTER, b, out, lo, n, exact=exact, first=True)

    def wait_master_written(self, b: int) -> None:
        """Block until every write of block b's master issued so far has landed."""
        self._files.wait_write(BufferKind.MASTER, b)
