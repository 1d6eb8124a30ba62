"""How close two honest float32 trainings must be when they cannot be bitwise equal.

Two trainings that differ only in summation order differ, after a few AdamW
steps, by sign flips on the few elements whose gradient is ~0 in both: so
differences are measured against the size of the update, not elementwise
against the weights (DESIGN.md section 8).
"""
from __future__ import annotations

from typing import Mapping

import torch


def assert_update_close(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                        initial: Mapping[str, torch.Tensor], what: str = "parameters",
                        noise_floor: Mapping[str, torch.Tensor] | None = None,
                        floor_bound: float | None = None) -> None:
    """99.9% of elements within 1e-3 of the mean absolute update, none beyond 5% of it.

    ``noise_floor`` (bool per element) marks elements whose gradient is at the float32 noise floor
    (the caller says which, and why): there two honest trainings may differ by a whole sign flip of
    the update, so those are held only to ``floor_bound`` (an absolute bound, e.g. a few learning
    rates) and the two rules above apply to every other element.
    """
    names = sorted(expected)
    assert sorted(actual) == names, f"{what}: different names"
    diff = torch.cat([(actual[n].double() - expected[n].double()).abs().flatten() for n in names])
    update = torch.cat([(expected[n].double() - initial[n].double()).abs().flatten() for n in names])
    scale = update.mean().item()
    if noise_floor is not None:
        floor = torch.cat([noise_floor[n].flatten() for n in names])
        if bool(floor.any()):
            assert floor_bound is not None
            assert diff[floor].max().item() <= floor_bound, f"{what}: a noise-floor element moved by more than {floor_bound}"
        diff = diff[~floor]
    if scale == 0.0 or diff.numel() == 0:
        assert diff.numel() == 0 or diff.max().item() == 0.0, f"{what}: no update expected, yet they differ"
        return
    within = (diff <= 1e-3 * scale).double().mean().item()
    worst = diff.max().item() / scale
    assert within >= 0.999, f"{what}: only {within:.4%} of elements within 1e-3 of the mean update {scale:.3e}"
    assert worst <= 0.05, f"{what}: worst element differs by {worst:.3%} of the mean update {scale:.3e}"


def assert_moments_close(exp_avg: Mapping[str, torch.Tensor], exp_avg_sq: Mapping[str, torch.Tensor],
                         ref_avg: Mapping[str, torch.Tensor], ref_avg_sq: Mapping[str, torch.Tensor],
                         eps: float, noise_floor: Mapping[str, torch.Tensor]) -> None:
    """AdamW's moments as the update uses them, m / (sqrt(v) + eps): m against sqrt(v) + eps, and sqrt(v)
    against sqrt(v) + eps. Outside the noise floor (see ``assert_update_close``): 99.9% within 1e-3 of
    that scale, none beyond 5% of it. (This scale is per element, so noise-floor elements, relative
    noise at its worst, are left out of both rules; the parameters' rule keeps them in its 99.9%.)

    An element's sqrt(v) counts as at least a tenth of its tensor's mean sqrt(v): the summation noise in a
    gradient is the size of the terms summed, which its tensor's typical gradients set, so below that an
    element's relative error grows only because its own gradient is small. (A drawn case, tied embeddings
    over 2 micro-batches with one-token attention tiles, had 0.18% of m's elements off by 1-6.5e-3 of their own
    scale, all with sqrt(v) at 1-10% of their tensor's median; against this floored scale, 0.05%.)"""
    names = sorted(ref_avg)
    flat = lambda d: torch.cat([d[n].double().flatten() for n in names])  # noqa: E731
    m, v, rm, rv = flat(exp_avg), flat(exp_avg_sq), flat(ref_avg), flat(ref_avg_sq)
    floor = torch.cat([noise_floor[n].flatten() for n in names])
    typical = torch.cat([torch.full((ref_avg_sq[n].numel(),), ref_avg_sq[n].double().sqrt().mean().item() / 10)
                         for n in names])
    scale = torch.maximum(rv.sqrt(), typical) + eps
    for what, err in (("exp_avg", (m - rm).abs() / scale), ("exp_avg_sq", (v.sqrt() - rv.sqrt()).abs() / scale)):
        err = err[~floor]
        if err.numel() == 0:
            continue
        within = (err <= 1e-3).double().mean().item()
        worst = err.max().item()
        assert within >= 0.999, f"{what}: only {within:.4%} of elements within 1e-3 of their scale"
        assert worst <= 0.05, f"{what}: worst element off by {worst:.3%} of its scale"


# How much farther from the float64 step than PyTorch's own float32 step megatrain's may be, per tensor.
EXACT_SLACK = 2.0
# ... plus this much of the tensor's norm: float32's own rounding of it (2^-24 ~ 6e-8 per element), whatever either
# training summed.
EXACT_ROUNDING = 1e-6


def nearer_exact(ours: Mapping[str, torch.Tensor], fp32: Mapping[str, torch.Tensor],
                 exact: Mapping[str, torch.Tensor], slack: float = EXACT_SLACK) -> list[str]:
    """The tensors where ``ours`` is more than ``slack`` times farther from ``exact`` (the same step in
    float64, from the same start) than ``fp32`` (PyTorch's in float32) is, by the norm of the difference: where megatrain's float32
    noise is not of the size of PyTorch's own. Empty: every tensor is within it.

    The rules above compare two float32 trainings, so they also fail where the reference is the noisy one: a drawn
    case with qk_norm and one-token attention tiles had 0.57% of m's elements beyond them, yet every tensor of
    megatrain's m and v was 3-14x nearer the float64 training than the reference's (cancelling terms in the
    query and key projections' gradients, summed in other orders). A real defect (a wrong tile, a lost micro-batch)
    moves a tensor by its gradient's size, far beyond float32 noise, and fails this too."""
    far = []
    for n in sorted(exact):
        truth = exact[n].double()
        mine, theirs = (ours[n].double() - truth).norm().item(), (fp32[n].double() - truth).norm().item()
        if mine > slack * theirs + EXACT_ROUNDING * truth.norm().item():
            far.append(f"{n} ({mine:.2e} against {theirs:.2e}, norm {truth.norm().item():.2e})")
    return far
