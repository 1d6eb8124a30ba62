"""The host store: every block's fp32 master, compute-dtype shadow, AdamW m and v, and fp32 grads.

One arena per buffer kind (``BufferKind``), allocated once at start, holding
that kind's blocks that stay in RAM in block order; with nothing of the kind
spilled, block b owns the fixed range ``[offset[b], offset[b] + numel[b])`` of
it (its layout's flat buffer). With CUDA the arenas that cross PCIe are pinned by
registering each whole allocation with the driver (``cudaHostRegister``): torch's
own pinned allocator rounds every request up to a power of two. They are the shadow
(host to GPU), the gradients and their slabs (GPU to host), and the master only
where it is the shadow (fp32 compute, or ``Plan.weights_cast="device"``: the loads
copy the master and round it on the GPU); m and v stay pageable: only AdamW on the CPU
reads them (``buffer_kinds.crosses_pcie``, the rule the memory model charges the
pinned budget by). Without CUDA nothing is pinned and the same code runs.

Host RAM: 4 (master) + 8 (m, v; 4 in bf16) + 2 (bf16 shadow; 0 in fp32 or with the cast on
the device, where the shadow is the master itself) bytes per parameter, plus 4 for the full gradient arena in
deferred mode, or ``slabs x largest block x 4`` bytes in eager mode. A spilled
block of a kind takes no RAM of that kind; spilling adds the staging sets and,
for spilled gradients, ``slabs x chunk x 4`` bytes (``Plan.spill_chunk_bytes``).
In fp32 a block whose master is spilled has no shadow at all: its loads read
it from the master file (``load_source``).

With a spill plan the blocks and kinds ``buffer_kinds.placement`` names live in
spill files instead (``spill_files.py``, [Note: spill]), each (block, kind) in
RAM or on disk independently, reached only through their one face (``disk``: ``spilled_state.py``, [Note: one
face of spilled state]); ``read_block`` /
``write_block`` are the one way to a block's bytes either way, and
``grad_sink`` says where a block's gradient lands on the host.

The blocks ``Plan.resident_blocks`` names keep no byte in RAM: their master, m, v and gradient are device
buffers (``ResidentState``, [Note: resident blocks]) that ``read_block`` / ``write_block``, ``load_source`` and
``grad_sink`` reach the same way.
"""
from __future__ import annotations

import queue
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, NamedTuple, Sequence

import torch

from megatrain.plan.buffer_kinds import (MOMENT_KINDS, BufferKind, Placement, crosses_pcie, load_bytes,
                                         spill_chunk_multiple, spill_chunk_numel, spilled_kinds)

from megatrain.runtime.errors import ConfigError
from megatrain.runtime.spill.spilled_state import SpilledState
from megatrain.runtime.spill.staging_pool import StagingPool
from megatrain.runtime.spill.spill_io import FileIO
from megatrain.runtime.state.resident_state import ResidentState
from megatrain.runtime.model.templates import Block

if TYPE_CHECKING:
    from megatrain.runtime.device.streams import Event

__all__ = ["BufferKind", "GradSink", "GradSlabs", "HostArena", "HostStore"]


class HostArena:
    """One contiguous host allocation of one dtype, pinned in place when ``pin`` (CUDA) and it ``crosses_pcie``."""

    def __init__(self, numel: int, dtype: torch.dtype, pin: bool, name: str, crosses_pcie: bool = True) -> None:
        self.name = name
        self.tensor = torch.zeros(numel, dtype=dtype)
        self.crosses_pcie = crosses_pcie  # copied to or from the GPU: what is pinned where there is one
        self.pinned = False  # registered with the driver (cudaHostRegister)
        if pin and crosses_pcie and numel > 0:
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            if int(err) != 0:
                raise MemoryError(
                    f"cannot pin the {name} arena ({self.nbytes / 2**30:.2f} GiB): cudaHostRegister returned "
                    f"{int(err)}; raise the locked-memory limit (ulimit -l) or plan for less host memory"
                )
            self.pinned = True

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False


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

    def acquire_checked(self, check: Callable[[], None]) -> int:
        """A free slab; while none is, ``check()`` runs every second (it may raise to stop waiting)."""
        while True:
            try:
                return self._free.get(timeout=1.0)
            except queue.Empty:
                check()

    def slab(self, index: int, numel: int) -> torch.Tensor:
        start = index * self.numel
        return self.arena.tensor[start:start + numel]

    def release(self, index: int) -> None:
        self._free.put_nowait(index)


class GradSink(NamedTuple):
    """Where block b's fp32 gradient drains to on the host, and what follows the drain."""

    host: torch.Tensor  # [n] fp32: the D2H copy's destination, for the block's elements [lo, lo + n)
    on_drained: Callable[["Event"], None]  # call once the drain is queued, with its completion event
    for_adam: torch.Tensor | None  # what AdamW reads the gradient from; None: from the grads spill file
    release: Callable[[], None] | None  # call once AdamW is done with ``host`` (frees an eager-mode slab)
    lo: int = 0  # the first element of the block this sink receives


class HostStore:
    def __init__(
        self,
        blocks: Sequence[Block],
        compute_dtype: torch.dtype,
        full_grads: bool,
        grad_slabs: int,
        pin: bool,
        placement: Placement | None = None,
        spill_dir: str | None = None,
        io: FileIO | None = None,
        staging: int = 1,
        chunk_bytes: int = 64 * 2**20,
        state_dtype: torch.dtype = torch.float32,
        weights_cast: str = "host",
        resident: ResidentState | None = None,
    ) -> None:
        """``state_dtype``: AdamW m and v's, in RAM and in their spill files (bf16: [Note: bf16 optimizer state]).
        ``weights_cast``: ``Plan.weights_cast``; "device": no shadow, the loads copy the master and round it.
        ``resident``: the state of the blocks kept on the device (none of theirs in RAM)."""
        self.resident = resident
        self._on_device = frozenset() if resident is None else resident.blocks
        self.offsets: list[int] = []
        total = 0
        for block in blocks:
            self.offsets.append(total)
            total += block.layout.numel
        self.numels = [b.layout.numel for b in blocks]
        self.total_numel = total
        self.max_block_numel = max(self.numels)
        self.compute_dtype = compute_dtype
        # The loads copy the fp32 master itself (no shadow): fp32 compute, or the plan rounds on the device.
        self.master_loaded = load_bytes(compute_dtype.itemsize, weights_cast) == 4
        # Per kind, the blocks in spill files (``buffer_kinds.placement``); eager mode: gradients pass through
        # slabs, never through a grads arena or file.
        self.placement: dict[BufferKind, frozenset[int]] = {
            k: frozenset(v) for k, v in (placement or {}).items() if v and (k is not BufferKind.GRADS or full_grads)}
        multiple = spill_chunk_multiple(state_dtype.itemsize)
        if state_dtype != torch.float32 and set(MOMENT_KINDS) & set(self.placement) and chunk_bytes % multiple:
            raise ConfigError(f"spill_chunk_bytes={chunk_bytes} must be a multiple of {multiple} ({multiple >> 20} "
                              "MiB) where bf16 AdamW m or v spill (their chunks start on the stochastic rounding's "
                              "pieces); plan again with megatrain-plan --optimizer-state bf16, or set a multiple of it")
        self.state_dtype = state_dtype
        self.spilled: tuple[BufferKind, ...] = spilled_kinds(self.placement)  # kinds with a block on disk
        # Per kind, each RAM block's element offset in its arena (the arena holds the kind's RAM blocks in order).
        self._ram_offsets: dict[BufferKind, dict[int, int]] = {}
        self.master = self._allocate(BufferKind.MASTER, "fp32 master", pin)
        self.exp_avg = self._allocate(BufferKind.EXP_AVG, "AdamW exp_avg", pin, state_dtype)
        self.exp_avg_sq = self._allocate(BufferKind.EXP_AVG_SQ, "AdamW exp_avg_sq", pin, state_dtype)
        # In fp32 compute, or with the cast on the device, the shadow is the RAM master itself: nothing to round on
        # the host, nothing to store twice; an fp32 block whose master is spilled has none, and its loads read the
        # master file (``load_source``). The cast on the device needs every master in RAM (``Plan`` refuses else).
        self.shadow: HostArena | None
        if self.master_loaded:
            assert compute_dtype == torch.float32 or BufferKind.MASTER not in self.placement
            self.shadow = self.master
        else:
            self._shadow_at, shadow_numel = _offsets(self.numels, self._on_device)
            self.shadow = HostArena(shadow_numel, compute_dtype, pin, "shadow")
        self.grads = self._allocate(BufferKind.GRADS, "fp32 grads", pin) if full_grads else None
        # Gradients land in slabs in eager mode, and on their way to the grads file for blocks whose grads spill.
        self.grads_spilled = BufferKind.GRADS in self.spilled
        need_slabs = not full_grads or self.grads_spilled
        # Spilled gradients drain a chunk at a time (rounded up to 4 KiB) into slabs written to the grads file.
        host_max = max((n for b, n in enumerate(self.numels) if b not in self._on_device), default=0)
        slab_numel = spill_chunk_numel(host_max, chunk_bytes) if self.grads_spilled else host_max
        self.slabs = GradSlabs(grad_slabs, slab_numel, pin) if need_slabs else None
        # AdamW step count per block, as torch.optim keeps it: a float32 CPU scalar tensor.
        # (a resident block's on the device, as the fused kernel there takes it).
        self.steps = [resident.steps[b] if b in self._on_device else torch.zeros((), dtype=torch.float32)  # type: ignore[union-attr]
                      for b in range(len(blocks))]
        self.disk: SpilledState | None = None  # the spill files' one face: [Note: one face of spilled state]
        if self.spilled:
            assert io is not None and spill_dir is not None
            try:
                self.disk = SpilledState(self.numels, self.placement, spill_dir, io, staging, chunk_bytes, state_dtype)
            except BaseException:
                self.close()
                raise

    def _allocate(self, kind: BufferKind, name: str, pin: bool,
                  dtype: torch.dtype = torch.float32) -> HostArena | None:
        """The arena of ``kind``'s blocks that stay in RAM, in block order (None when every block spills or is
        resident)."""
        offsets, at = _offsets(self.numels, self.placement.get(kind, frozenset()) | self._on_device)
        self._ram_offsets[kind] = offsets
        crosses = crosses_pcie(kind, self.master_loaded)
        return HostArena(at, dtype, pin, name, crosses) if offsets else None

    def dtype(self, kind: BufferKind) -> torch.dtype:
        """``kind``'s dtype, in RAM and on disk alike: the state dtype for m and v, else fp32."""
        return self.state_dtype if kind in MOMENT_KINDS else torch.float32

    def is_spilled(self, kind: BufferKind, b: int) -> bool:
        """Whether block b's ``kind`` lives in its spill file."""
        return b in self.placement.get(kind, ())

    # ---- spill files ------------------------------------------------------------------
    @property
    def nvme_bytes(self) -> int:
        return 0 if self.disk is None else self.disk.nbytes

    @property
    def spill_root(self) -> str | None:
        return None if self.disk is None else self.disk.root

    @property
    def staging(self) -> StagingPool | None:
        return None if self.disk is None else self.disk.staging

    def flush(self) -> None:
        """Wait for every write behind to the spill files (raises the first I/O error)."""
        if self.disk is not None:
            self.disk.flush()

    # ---- block access -------------------------------------------------------------------
    def ram_arena(self, kind: BufferKind) -> HostArena | None:
        """The arena of ``kind``'s blocks in RAM (every block, or those not spilled), None when it has none."""
        return {BufferKind.MASTER: self.master, BufferKind.EXP_AVG: self.exp_avg,
                BufferKind.EXP_AVG_SQ: self.exp_avg_sq, BufferKind.GRADS: self.grads}[kind]

    def arena(self, kind: BufferKind) -> HostArena | None:
        """The RAM arena of ``kind`` when it holds every block in order; None when any block of the kind is
        spilled (read those block by block: ``read_block``) or the kind is not kept."""
        return None if kind in self.spilled or self._on_device else self.ram_arena(kind)

    def copies(self, kind: BufferKind, b: int) -> bool:
        """Whether ``read_block(kind, b)`` is a copy (spilled, or resident on a GPU) that ``write_block`` stores."""
        return self.is_spilled(kind, b) or (b in self._on_device and self.resident.copies)  # type: ignore[union-attr]

    def _view(self, kind: BufferKind, b: int) -> torch.Tensor:
        arena = self.ram_arena(kind)
        assert arena is not None and b in self._ram_offsets[kind], "this block's kind is spilled or not kept"
        lo = self._ram_offsets[kind][b]
        return arena.tensor[lo:lo + self.numels[b]]

    def read_block(self, kind: BufferKind, b: int) -> torch.Tensor:
        """Block b's ``kind`` ([numel], ``dtype(kind)``: fp32, m and v in the state dtype): a view of RAM (writes
        to it are the store's), or, spilled, a copy read from its file; resident, ``ResidentState.read``."""
        if b in self._on_device:
            assert self.resident is not None
            return self.resident.read(kind, b)
        if self.is_spilled(kind, b):
            assert self.disk is not None
            return self.disk.read_block(kind, b)
        return self._view(kind, b)

    def write_block(self, kind: BufferKind, b: int, src: torch.Tensor) -> None:
        """Store ``src`` ([numel], converted to ``dtype(kind)``) as block b's ``kind`` (RAM copy, or a synchronous
        file write; resident: into its device buffer)."""
        if b in self._on_device:
            assert self.resident is not None
            self.resident.write(kind, b, src)
        elif self.is_spilled(kind, b):
            assert self.disk is not None
            self.disk.write_block(kind, b, src)
        else:
            self._view(kind, b).copy_(src)

    def load_source(self, b: int) -> torch.Tensor | None:
        """Block b's compute-dtype weights in RAM, what travels H2D; None when they are read from the master
        spill file instead (fp32 compute with block b's master spilled: no second copy in RAM); a resident block's
        fp32 master on the device, which its load casts there."""
        if b in self._on_device:
            assert self.resident is not None
            return self.resident.view(BufferKind.MASTER, b)
        if self.shadow is self.master:
            return None if self.is_spilled(BufferKind.MASTER, b) else self._view(BufferKind.MASTER, b)
        assert self.shadow is not None
        return self.shadow.tensor[self._shadow_at[b]:self._shadow_at[b] + self.numels[b]]

    def refresh_shadow(self, b: int, master: torch.Tensor | None = None, lo: int = 0) -> None:
        """Round block b's master (``master``, elements [lo, lo + len) if given, else the stored block) into
        its compute-dtype shadow."""
        if self.shadow is not self.master and self.shadow is not None and b not in self._on_device:
            src = self.read_block(BufferKind.MASTER, b) if master is None else master
            at = self._shadow_at[b] + lo
            self.shadow.tensor[at:at + src.numel()].copy_(src)

    # ---- gradients ----------------------------------------------------------------------
    def grad_sinks(self, b: int, check: Callable[[], None] = lambda: None) -> Iterable[GradSink]:
        """Where block b's gradient drains to, piece by piece: deferred mode, its range of the grads arena;
        eager mode, a slab AdamW frees when done; block b's grads spilled, one slab per chunk, written to the grads
        file behind its drain (AdamW reads the chunks back from there, after those writes). Waiting for a
        free slab calls ``check`` every second (e.g. to raise the AdamW worker's error instead of waiting
        for ever). A spilled block's slabs are acquired one at a time, as the iteration reaches them. A resident
        block's gradient is its device buffer, where it added up: its drain copies nothing."""
        if b in self._on_device:
            assert self.resident is not None
            grads = self.resident.view(BufferKind.GRADS, b)
            return [GradSink(grads, lambda done: None, grads, None)]
        if self.slabs is None or (self.grads is not None and not self.is_spilled(BufferKind.GRADS, b)):
            host = self._view(BufferKind.GRADS, b)
            return [GradSink(host, lambda done: None, host, None)]
        if not self.grads_spilled:
            slabs, slab = self.slabs, self.slabs.acquire_checked(check)
            host = slabs.slab(slab, self.numels[b])
            return [GradSink(host, lambda done: None, host, lambda: slabs.release(slab))]
        assert self.disk is not None
        return _spilled_sinks(self.slabs, self.disk, b, check)

    def resident_grads(self, b: int) -> torch.Tensor | None:
        """A resident block's gradient buffer on the device, where its gradients add up; None for another block."""
        return None if self.resident is None or b not in self.resident else self.resident.view(BufferKind.GRADS, b)

    def grad_sink(self, b: int, check: Callable[[], None] = lambda: None) -> GradSink:
        """The first (for a block in RAM, the only) sink of ``grad_sinks(b)``."""
        return next(iter(self.grad_sinks(b, check)))

    def arenas(self) -> list[HostArena]:
        """Every RAM arena of the store, each once (in fp32 the shadow is the master)."""
        arenas = [self.master, self.exp_avg, self.exp_avg_sq, self.grads, self.slabs.arena if self.slabs else None]
        if self.shadow is not self.master:
            arenas.append(self.shadow)
        return [a for a in arenas if a is not None]

    @property
    def nbytes(self) -> int:
        staging = 0 if self.staging is None else self.staging.nbytes
        return sum(a.nbytes for a in self.arenas()) + staging

    @property
    def pcie_bytes(self) -> int:
        """Bytes of the arenas copied to or from the GPU: those pinned with CUDA (the memory model's pinned terms)."""
        return sum(a.nbytes for a in self.arenas() if a.crosses_pcie)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the arenas registered with the driver now: ``pcie_bytes`` with CUDA, 0 without."""
        return sum(a.nbytes for a in self.arenas() if a.pinned)

    def close(self) -> None:
        for arena in (self.master, self.exp_avg, self.exp_avg_sq, self.shadow, self.grads,
                      self.slabs.arena if self.slabs else None):
            if arena is not None:
                arena.close()
        if self.disk is not None:
            self.disk.close()
            self.disk = None


def _offsets(numels: Sequence[int], skip: frozenset[int]) -> tuple[dict[int, int], int]:
    """Each block not in ``skip``: its first element in an arena of those blocks in block order; and their total."""
    out, at = {}, 0
    for b, n in enumerate(numels):
        if b not in skip:
            out[b], at = at, at + n
    return out, at


def _spilled_sinks(slabs: GradSlabs, disk: SpilledState, b: int, check: Callable[[], None]) -> Iterator[GradSink]:
    """Block b's spilled-gradient sinks, one per chunk, each slab acquired only when the drain reaches it
    (so a block larger than every slab together still drains), written to the grads file behind its drain."""
    for lo, n in disk.chunks(b):
        slab = slabs.acquire_checked(check)
        padded = slabs.slab(slab, slabs.numel)

        def on_drained(done: "Event", padded: torch.Tensor = padded, slab: int = slab, lo: int = lo, n: int = n) -> None:
            written = disk.write_grads(b, padded, done, lo, n)
            written.add_done_callback(lambda _: slabs.release(slab))  # the slab back once its bytes are on disk
        yield GradSink(padded[:n], on_drained, None, None, lo)
