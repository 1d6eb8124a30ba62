"""How close two honest float32 trainings must be when they cannot be bitwise equal.

Two trainings that differ only in summation order differ, after a few AdamW
steps, by sign flips on the few elements whose gradient is ~0 in both: so
differences are measured against the size of the update, not elementwise
against the weights (design.md section 8).
"""
from __future__ import annotations

from typing import Mapping

import torch


def assert_update_close(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                        initial: Mapping[str, torch.Tensor], what: str = "parameters") -> None:
    """99.9% of elements within 1e-3 of the mean absolute update, none beyond 5% of it."""
    names = sorted(expected)
    assert sorted(actual) == names, f"{what}: different names"
    diff = torch.cat([(actual[n].double() - expected[n].double()).abs().flatten() for n in names])
    update = torch.cat([(expected[n].double() - initial[n].double()).abs().flatten() for n in names])
    scale = update.mean().item()
    if scale == 0.0:
        assert diff.max().item() == 0.0, f"{what}: no update expected, yet they differ by {diff.max().item()}"
        return
    within = (diff <= 1e-3 * scale).double().mean().item()
    worst = diff.max().item() / scale
    assert within >= 0.999, f"{what}: only {within:.4%} of elements within 1e-3 of the mean update {scale:.3e}"
    assert worst <= 0.05, f"{what}: worst element differs by {worst:.3%} of the mean update {scale:.3e}"


def assert_state_close(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], what: str) -> None:
    """Optimizer moments: the same rule, with the moment itself as the scale (it starts at zero)."""
    zeros = {n: torch.zeros_like(t) for n, t in expected.items()}
    assert_update_close(actual, expected, zeros, what)
