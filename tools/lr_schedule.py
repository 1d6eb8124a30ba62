"""Learning-rate schedule: linear warmup, then cosine decay to a floor.

A pure function of the step, so resuming needs only the step number (saved in the checkpoint's
``extra`` together with these parameters, to tell when a resumed run changed them).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CosineSchedule:
    peak_lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int

    def __post_init__(self) -> None:
        assert 0 <= self.min_lr <= self.peak_lr and self.warmup_steps >= 0 and self.total_steps >= 1

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (1-based).

        step <= warmup: peak x step / warmup; after: min + (peak - min) x (1 + cos(pi x t)) / 2 with
        t = (step - warmup) / (total - warmup) in [0, 1]; past the end, min.
        """
        if step <= self.warmup_steps:
            return self.peak_lr * step / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        t = min(1.0, (step - self.warmup_steps) / span)
        return self.min_lr + (self.peak_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def from_config(lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> CosineSchedule:
    """-1 sentinels of the config: min_lr = lr / 10, warmup = 10% of the steps (at most 1000)."""
    floor = lr / 10 if min_lr < 0 else min_lr
    warmup = min(1000, total_steps // 10) if warmup_steps < 0 else min(warmup_steps, total_steps)
    return CosineSchedule(lr, floor, warmup, total_steps)
