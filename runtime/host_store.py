"""The host store: every block's fp32 master, compute-dtype shadow, AdamW m and v, and fp32 grads.

One arena per buffer kind, allocated once at start; block b owns the fixed
range ``[offset[b], offset[b] + numel[b])`` of each (its layout's flat buffer).
With CUDA the arenas are pinned by registering each whole allocation with the
driver (``cudaHostRegister``): torch's own pinned allocator rounds every request
up to a power of two. Without CUDA they are ordinary memory and the same code runs.

Host RAM: 4 (master) + 8 (m, v) + 2 (bf16 shadow; 0 in fp32, where the shadow
is the master itself) bytes per parameter, plus 4 for the full gradient arena in
deferred mode, or ``slabs x largest block x 4`` bytes in eager mode.

[Note: spill]
With a spill plan, some fp32 kinds live in preallocated spill files instead
(``optimizer``: m and v; ``all``: master, m, v and the deferred-mode gradients),
each block at a fixed 4 KiB-aligned offset. They are touched only through
staging sets (``StagingPool``): AdamW reads a block's spilled state into one,
updates it there, and writes it back behind; ``read_block`` / ``write_block``
serve the cold paths (init, state dicts, checkpoints). A block's reads wait for
its previous writes. The compute-dtype shadow (what travels H2D) always stays
in RAM; in fp32 with a spilled master it is an fp32 copy in RAM.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import shutil
import threading
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from . import spill_dirs
from .spill_io import DIRECT_ALIGN, FileIO, SpillSpaceError, aligned_empty
from .templates import Block

if TYPE_CHECKING:
    from .streams import Event

KINDS = ("master", "exp_avg", "exp_avg_sq", "grads")
SPILLED_KINDS = {"none": (), "optimizer": ("exp_avg", "exp_avg_sq"), "all": ("master", "exp_avg", "exp_avg_sq", "grads")}


class HostArena:
    """One contiguous host allocation of one dtype, pinned in place when ``pin``."""

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool, name: str) -> None:
        self.name = name
        self.tensor = torch.zeros(numel, dtype=dtype)
        self._registered = False
        if pin and numel > 0:
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            if int(err) != 0:
                raise MemoryError(
                    f"cannot pin the {name} arena ({self.nbytes / 2**30:.2f} GiB): cudaHostRegister returned "
                    f"{int(err)}; raise the locked-memory limit (ulimit -l) or plan for less host memory"
                )
            self._registered = True

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def close(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self._registered = False


class GradSlabs:
    """Eager mode: a bounded pool of host fp32 slabs that carry a block's grads from D2H to AdamW.

    Bound: ``count`` slabs of ``numel`` fp32 elements (count x largest block x 4 bytes).
    ``acquire`` blocks the caller while every slab waits for its AdamW update.
    """

    def __init__(self, count: int, numel: int, pin: bool) -> None:
        self.arena = HostArena(count * numel, torch.float32, pin, "gradient slabs")
        self.numel = numel
        self._free: queue.Queue[int] = queue.Queue(maxsize=count)
        for i in range(count):
            self._free.put(i)

    def acquire(self, timeout: float | None = None) -> int:
        return self._free.get(timeout=timeout)

    def slab(self, index: int, numel: int) -> torch.Tensor:
        start = index * self.numel
        return self.arena.tensor[start:start + numel]

    def release(self, index: int) -> None:
        self._free.put_nowait(index)


class StagingPool:
    """Bounded sets of aligned fp32 host buffers between spill files and CPU AdamW.

    Bound: ``count`` sets x spilled kinds x largest block (rounded up to 4 KiB) x 4 bytes.
    """

    def __init__(self, count: int, kinds: Sequence[str], block_bytes: int) -> None:
        self._sets = [{k: aligned_empty(block_bytes).view(torch.float32) for k in kinds} for _ in range(count)]
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(count):
            self._free.put(i)

    def acquire(self) -> int:
        return self._free.get()

    def buffers(self, index: int) -> dict[str, torch.Tensor]:
        return self._sets[index]

    def release(self, index: int) -> None:
        self._free.put_nowait(index)


class HostStore:
    def __init__(
        self,
        blocks: Sequence[Block],
        compute_dtype: torch.dtype,
        full_grads: bool,
        grad_slabs: int,
        pin: bool,
        spill: str = "none",
        spill_dir: str | None = None,
        io: FileIO | None = None,
        staging: int = 1,
    ) -> None:
        self.offsets: list[int] = []
        total = 0
        for block in blocks:
            self.offsets.append(total)
            total += block.layout.numel
        self.numels = [b.layout.numel for b in blocks]
        self.total_numel = total
        self.max_block_numel = max(self.numels)
        self.compute_dtype = compute_dtype
        self.spilled: tuple[str, ...] = SPILLED_KINDS[spill]
        if not full_grads:  # eager mode: gradients pass through slabs, never through a grads arena or file
            self.spilled = tuple(k for k in self.spilled if k != "grads")
        ram = lambda kind, name: None if kind in self.spilled else HostArena(total, torch.float32, pin, name)  # noqa: E731
        self.master = ram("master", "fp32 master")
        self.exp_avg = ram("exp_avg", "AdamW exp_avg")
        self.exp_avg_sq = ram("exp_avg_sq", "AdamW exp_avg_sq")
        # In fp32 compute the shadow is the RAM master itself: nothing to round, nothing to store twice.
        if compute_dtype == torch.float32 and self.master is not None:
            self.shadow = self.master
        else:
            self.shadow = HostArena(total, compute_dtype, pin, "shadow")
        self.grads = ram("grads", "fp32 grads") if full_grads else None
        # Gradients land in slabs in eager mode, and on their way to the grads file when it spills.
        need_slabs = not full_grads or "grads" in self.spilled
        # A spilled block is written whole, rounded up to 4 KiB: slabs feeding the grads file are that long.
        slab_numel = _round_up(self.max_block_numel, DIRECT_ALIGN // 4) if "grads" in self.spilled else self.max_block_numel
        self.slabs = GradSlabs(grad_slabs, slab_numel, pin) if need_slabs else None
        # AdamW step count per block, as torch.optim keeps it: a float32 CPU scalar tensor.
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in blocks]

        self.io = io
        self.spill_root: str | None = None
        self.files: dict[str, int] = {}
        self.staging: StagingPool | None = None
        self.staging_count = staging
        # Writes that must wait for a D2H drain first run from here, so no caller blocks on the GPU.
        self._after_pool: cf.ThreadPoolExecutor | None = None
        self._writes: dict[tuple[str, int], cf.Future] = {}  # last write of each (kind, block)
        self._writes_lock = threading.Lock()
        if self.spilled:
            assert io is not None and spill_dir is not None
            self._open_spill(spill_dir, staging)

    # ---- spill files ------------------------------------------------------------------
    def _open_spill(self, spill_dir: str, staging: int) -> None:
        self.spill_root = spill_dirs.create(spill_dir)  # named after this process; dead owners' ones reclaimed
        self.block_bytes = [_round_up(n * 4, DIRECT_ALIGN) for n in self.numels]
        self.file_offsets, at = [], 0
        for nbytes in self.block_bytes:
            self.file_offsets.append(at)
            at += nbytes
        self.file_bytes = at
        try:
            free = shutil.disk_usage(self.spill_root).free
            if self.nvme_bytes > free:  # the total, before any file takes its share
                raise _no_space(spill_dir, self.spilled, self.nvme_bytes, free)
            for kind in self.spilled:
                self.files[kind] = self.io.open(os.path.join(self.spill_root, f"{kind}.bin"), at)  # type: ignore[union-attr]
        except SpillSpaceError:
            self.close()
            raise _no_space(spill_dir, self.spilled, self.nvme_bytes, shutil.disk_usage(spill_dir).free) from None
        except BaseException:
            self.close()
            raise
        self.staging = StagingPool(staging, self.spilled, max(self.block_bytes))

    @property
    def nvme_bytes(self) -> int:
        return len(self.spilled) * self.file_bytes if self.spilled else 0

    def read_async(self, kind: str, b: int, out: torch.Tensor) -> cf.Future:
        """Spilled ``kind`` of block b into ``out`` (fp32, >= block bytes), after its previous write."""
        self.wait_write(kind, b)
        return self.io.read(self.files[kind], self.file_offsets[b], out.view(torch.uint8)[:self.block_bytes[b]])  # type: ignore[union-attr]

    def write_async(self, kind: str, b: int, src: torch.Tensor) -> cf.Future:
        future = self.io.write(self.files[kind], self.file_offsets[b], src.view(torch.uint8)[:self.block_bytes[b]])  # type: ignore[union-attr]
        with self._writes_lock:
            self._writes[(kind, b)] = future
        return future

    def write_after(self, kind: str, b: int, src: torch.Tensor, ready: "Event", then: Callable[[], None]) -> None:
        """Write ``src`` (>= block bytes) as block b's ``kind`` once ``ready`` (a D2H drain) has happened.

        Registered at once, so a later read of the block waits for it; ``then`` runs when it is done.
        """
        placeholder: cf.Future = cf.Future()
        with self._writes_lock:
            self._writes[(kind, b)] = placeholder
        if self._after_pool is None:
            self._after_pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-drain-write")
        io, handle, offset, view = self.io, self.files[kind], self.file_offsets[b], src.view(torch.uint8)[:self.block_bytes[b]]

        def run() -> None:
            try:
                ready.synchronize()
                io.write(handle, offset, view).result()  # type: ignore[union-attr]
                placeholder.set_result(None)
            except BaseException as e:
                placeholder.set_exception(e)
            finally:
                then()
        self._after_pool.submit(run)

    def wait_write(self, kind: str, b: int) -> None:
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

    # ---- block access -------------------------------------------------------------------
    def _arena(self, kind: str) -> HostArena | None:
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "grads": self.grads}[kind]

    def _range(self, arena: HostArena | None, b: int) -> torch.Tensor:
        assert arena is not None, "this kind is spilled: use read_block / write_block or a staging set"
        return arena.tensor[self.offsets[b]:self.offsets[b] + self.numels[b]]

    def read_block(self, kind: str, b: int) -> torch.Tensor:
        """Block b's fp32 ``kind`` ([numel]): a view of RAM, or a copy read from its spill file."""
        if kind not in self.spilled:
            return self._range(self._arena(kind), b)
        buf = aligned_empty(self.block_bytes[b]).view(torch.float32)
        self.read_async(kind, b, buf).result()
        return buf[:self.numels[b]]

    def write_block(self, kind: str, b: int, src: torch.Tensor) -> None:
        """Store ``src`` ([numel] fp32) as block b's ``kind`` (RAM copy, or a synchronous file write)."""
        if kind not in self.spilled:
            self._range(self._arena(kind), b).copy_(src)
            return
        buf = aligned_empty(self.block_bytes[b]).view(torch.float32)
        buf.zero_()
        buf[:self.numels[b]].copy_(src)
        self.write_async(kind, b, buf).result()

    def master_of(self, b: int) -> torch.Tensor:
        return self._range(self.master, b)

    def shadow_of(self, b: int) -> torch.Tensor:
        return self._range(self.shadow, b)

    def exp_avg_of(self, b: int) -> torch.Tensor:
        return self._range(self.exp_avg, b)

    def exp_avg_sq_of(self, b: int) -> torch.Tensor:
        return self._range(self.exp_avg_sq, b)

    def grads_of(self, b: int) -> torch.Tensor:
        return self._range(self.grads, b)

    def refresh_shadow(self, b: int, master: torch.Tensor | None = None) -> None:
        """Round block b's master (``master`` if given, else the stored one) into its compute-dtype shadow."""
        if self.shadow is not self.master:
            self.shadow_of(b).copy_(self.read_block("master", b) if master is None else master)

    @property
    def nbytes(self) -> int:
        arenas = [self.master, self.exp_avg, self.exp_avg_sq, self.grads, self.slabs.arena if self.slabs else None]
        if self.shadow is not self.master:
            arenas.append(self.shadow)
        staging = 0
        if self.staging is not None:
            staging = sum(t.numel() * 4 for s in self.staging._sets for t in s.values())
        return sum(a.nbytes for a in arenas if a is not None) + staging

    def close(self) -> None:
        for arena in (self.master, self.exp_avg, self.exp_avg_sq, self.shadow, self.grads,
                      self.slabs.arena if self.slabs else None):
            if arena is not None:
                arena.close()
        if self._after_pool is not None:
            self._after_pool.shutdown(wait=True)
            self._after_pool = None
        if self.io is not None:
            self.io.close()
            self.io = None
        if self.spill_root is not None:
            shutil.rmtree(self.spill_root, ignore_errors=True)
            self.spill_root = None


def _no_space(spill_dir: str, kinds: Sequence[str], need: int, free: int) -> SpillSpaceError:
    return SpillSpaceError(f"the spill files ({', '.join(f'{k}.bin' for k in kinds)}) need {_size(need)} in all but "
                           f"{spill_dir} has {_size(free)} free; free space, choose another "
                           "spill_dir, or spill less")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k
