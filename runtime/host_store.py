"""The host store: every block's fp32 master, compute-dtype shadow, AdamW m and v, and fp32 grads.

One arena per buffer kind, allocated once at start; block b owns the fixed
range ``[offset[b], offset[b] + numel[b])`` of each (its layout's flat buffer).
With CUDA the arenas are pinned by registering each whole allocation with the
driver (``cudaHostRegister``): torch's own pinned allocator rounds every request
up to a power of two. Without CUDA they are ordinary memory and the same code runs.

Host RAM: 4 (master) + 8 (m, v) + 2 (bf16 shadow; 0 in fp32, where the shadow
is the master itself) bytes per parameter, plus 4 for the full gradient arena in
deferred mode, or ``slabs x largest block x 4`` bytes in eager mode.
"""
from __future__ import annotations

import queue
from typing import Sequence

import torch

from .templates import Block


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


class HostStore:
    def __init__(
        self,
        blocks: Sequence[Block],
        compute_dtype: torch.dtype,
        full_grads: bool,
        grad_slabs: int,
        pin: bool,
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
        self.master = HostArena(total, torch.float32, pin, "fp32 master")
        self.exp_avg = HostArena(total, torch.float32, pin, "AdamW exp_avg")
        self.exp_avg_sq = HostArena(total, torch.float32, pin, "AdamW exp_avg_sq")
        # In fp32 compute the shadow is the master itself: nothing to round, nothing to store twice.
        self.shadow = self.master if compute_dtype == torch.float32 else HostArena(total, compute_dtype, pin, "shadow")
        self.grads = HostArena(total, torch.float32, pin, "fp32 grads") if full_grads else None
        self.slabs = None if full_grads else GradSlabs(grad_slabs, self.max_block_numel, pin)
        # AdamW step count per block, as torch.optim keeps it: a float32 CPU scalar tensor.
        self.steps = [torch.zeros((), dtype=torch.float32) for _ in blocks]

    def _range(self, arena: HostArena, b: int) -> torch.Tensor:
        return arena.tensor[self.offsets[b]:self.offsets[b] + self.numels[b]]

    def master_of(self, b: int) -> torch.Tensor:
        return self._range(self.master, b)

    def shadow_of(self, b: int) -> torch.Tensor:
        return self._range(self.shadow, b)

    def exp_avg_of(self, b: int) -> torch.Tensor:
        return self._range(self.exp_avg, b)

    def exp_avg_sq_of(self, b: int) -> torch.Tensor:
        return self._range(self.exp_avg_sq, b)

    def grads_of(self, b: int) -> torch.Tensor:
        assert self.grads is not None, "deferred mode keeps a full gradient arena"
        return self._range(self.grads, b)

    def refresh_shadow(self, b: int) -> None:
        """Round block b's master into its compute-dtype shadow (after init, load or update)."""
        if self.shadow is not self.master:
            self.shadow_of(b).copy_(self.master_of(b))

    @property
    def nbytes(self) -> int:
        arenas = [self.master, self.exp_avg, self.exp_avg_sq]
        if self.shadow is not self.master:
            arenas.append(self.shadow)
        if self.grads is not None:
            arenas.append(self.grads)
        if self.slabs is not None:
            arenas.append(self.slabs.arena)
        return sum(a.nbytes for a in arenas)

    def close(self) -> None:
        for arena in (self.master, self.exp_avg, self.exp_avg_sq, self.shadow, self.grads,
                      self.slabs.arena if self.slabs else None):
            if arena is not None:
                arena.close()
