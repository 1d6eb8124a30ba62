"""The state of the resident blocks: their fp32 master, AdamW m and v, gradient and step count in device memory.

[Note: resident blocks]
``Plan.resident_blocks`` names the blocks whose optimizer state lives on the device, not in host RAM: four fp32
device buffers (master, m, v, gradient), 16 bytes a parameter, each holding those blocks in block order, and a
float32 step count per block on the device (as ``torch.optim.AdamW(fused=True)`` keeps it on CUDA). Such a block
never crosses PCIe: a load casts its master into the slot on the device, its gradient adds up in its own device
buffer (the gradient buffers' drain of it copies nothing), and the device AdamW (runtime/optim/device_adamw.py)
updates it there. The host store keeps none of its bytes (no master, m, v, shadow or gradient in RAM) and reaches
them through this object, so state dicts, exports and checkpoints read and write them as any other block's: a
view where the device is the CPU, a host copy from a GPU.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megatrain.plan.buffer_kinds import BufferKind

from megatrain.runtime.model.templates import Block

RESIDENT_KINDS = (BufferKind.MASTER, BufferKind.EXP_AVG, BufferKind.EXP_AVG_SQ, BufferKind.GRADS)


class ResidentState:
    """Device memory: 16 x (the resident blocks' elements) bytes, in four buffers, and one scalar per block."""

    def __init__(self, blocks: Sequence[int], numels: Sequence[int], device: torch.device) -> None:
        self.blocks = frozenset(blocks)
        self.device = device
        self._at: dict[int, int] = {}  # block -> its first element in each buffer
        total = 0
        for b in sorted(self.blocks):
            self._at[b], total = total, total + numels[b]
        self._numels = {b: numels[b] for b in self.blocks}
        self.numel = total
        self.buffers = {kind: torch.zeros(total, dtype=torch.float32, device=device) for kind in RESIDENT_KINDS}
        self.steps = {b: torch.zeros((), dtype=torch.float32, device=device) for b in sorted(self.blocks)}

    @classmethod
    def of(cls, resident: Sequence[int], blocks: Sequence[Block], device: torch.device) -> "ResidentState | None":
        """The state of ``Plan.resident_blocks`` among ``blocks`` (None: the plan names none)."""
        return cls(resident, [b.layout.numel for b in blocks], device) if resident else None

    def __contains__(self, b: int) -> bool:
        return b in self.blocks

    def view(self, kind: BufferKind, b: int) -> torch.Tensor:
        """Block b's ``kind`` ([numel] fp32 on the device), the buffer itself."""
        lo = self._at[b]
        return self.buffers[kind][lo:lo + self._numels[b]]

    @property
    def copies(self) -> bool:
        """Whether reading a block for the host copies it (a GPU), else the view is host memory already."""
        return self.device.type != "cpu"

    def read(self, kind: BufferKind, b: int) -> torch.Tensor:
        """Block b's ``kind`` for the host: the view on a CPU device, a host copy from a GPU (waits for it)."""
        view = self.view(kind, b)
        return view.to("cpu") if self.copies else view

    def write(self, kind: BufferKind, b: int, src: torch.Tensor) -> None:
        """Store ``src`` ([numel], any float dtype) as block b's ``kind``."""
        self.view(kind, b).copy_(src)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())
