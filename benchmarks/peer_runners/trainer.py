"""What the peers' trainers answer alike, written once: the child's questions (``child.py``) after the steps.

A peer runs its step on a torch device: draining waits for that device, the step has no breakdown (megatrain's
trainer reports one), and host memory is pinned through torch's pinned allocator, whose statistics the child reads.
"""
from __future__ import annotations

import torch


class TorchTrainer:
    """The answers of a trainer whose model lives on ``self.device``; a system overrides what it does otherwise."""

    device: torch.device

    def drain(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def breakdown(self) -> None:
        return None

    def pinned_bytes(self) -> int | None:
        return None  # through torch's pinned allocator: the child reads its statistics
