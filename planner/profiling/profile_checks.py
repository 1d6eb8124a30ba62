"""Whether a measured figure is plausible against the others, and measuring again until it is.

A profile taken on a busy machine can hold one figure far off (another process ran through that benchmark's
samples). Two checks find it, both used by ``megatrain-plan profile`` while it measures and by
``megatrain-plan calibrate`` before it trusts a saved profile:

  spread     a figure's repeated samples (times; the disk's passes, each a read and a write of the same bytes)
             spread by more than SAMPLE_SPREAD_MAX (max / min - 1): its samples are measured again, up to
             REMEASURE_TRIES rounds, and the steadiest round is kept
  attention  causal attention (forward + backward, FLOPs as the planner counts them) runs on the same
             matmul units as the layers; at any sequence length its rate more than ATTENTION_BELOW_MATMUL_MAX
             times below the same dtype's matmul rate is a disturbed measurement, not the machine

Pure stdlib.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, TypeVar

T = TypeVar("T")

# Samples of one figure whose times spread by more than this (max / min - 1) are measured again.
SAMPLE_SPREAD_MAX = 0.5
# Rounds of samples at most for one figure (the first included) before the steadiest is kept.
REMEASURE_TRIES = 3
# Causal attention more than this many times below its dtype's matmul rate is not believed. (Measured on a
# quiet 2-core CPU: fp32 attention at 256 .. 4096 tokens runs 2-6x below the 1024-cube matmul; on GPUs flash
# attention runs within 2x of it.)
ATTENTION_BELOW_MATMUL_MAX = 25.0
# A run's attention, timed at the profile's attention rate, longer than this share of its whole measured
# compute: the attention rate is off (the attention is a part of that compute).
ATTENTION_SHARE_MAX = 0.8


@dataclass(frozen=True)
class Implausible:
    """A figure that is off: which (``figure``, as the profile names it), its value, and why."""

    figure: str
    value: float
    reason: str
    dtype: str = ""  # the profile's dtype name the figure is of ("float32"), where it has one

    def line(self) -> str:
        return f"{self.figure} = {self.value:.4g}: {self.reason}"


def spread(samples: Sequence[float]) -> float:
    """(max - min) / min of the samples; 0 for fewer than two or a zero minimum."""
    if len(samples) < 2 or min(samples) <= 0:
        return 0.0
    return (max(samples) - min(samples)) / min(samples)


def steadiest_round(take: Callable[[], Sequence[T]], times: Callable[[Sequence[T]], Sequence[float]], what: str,
                    log: Callable[[str], None], bound: float = SAMPLE_SPREAD_MAX,
                    tries: int = REMEASURE_TRIES) -> Sequence[T]:
    """A round of samples (``take``) whose ``times`` spread within ``bound``; a round spread wider is measured
    again (said through ``log``), up to ``tries`` rounds; then the steadiest round is kept, and ``log`` says so."""
    rounds = []
    for attempt in range(1, tries + 1):
        samples = take()
        rounds.append(samples)
        s = spread(times(samples))
        if s <= bound:
            return samples
        if attempt < tries:
            log(f"{what}: samples spread {s:.0%}, above the {bound:.0%} bound (a busy machine?): measuring again "
                f"({attempt + 1}/{tries})")
    best = min(rounds, key=lambda r: spread(times(r)))
    log(f"{what}: samples still spread {spread(times(best)):.0%} after {tries} rounds; keeping the steadiest round's "
        "fastest (measure again on a quiet machine for a tighter figure)")
    return best


def steady_minimum(take: Callable[[], Sequence[float]], what: str, log: Callable[[str], None],
                   bound: float = SAMPLE_SPREAD_MAX, tries: int = REMEASURE_TRIES) -> float:
    """The minimum of a round of times (``take``) chosen by ``steadiest_round``."""
    return min(steadiest_round(lambda: list(take()), lambda r: r, what, log, bound, tries))


def attention_findings(matmul: Mapping[str, float],
                       attention: Mapping[str, Sequence[tuple[int, float]]]) -> list[Implausible]:
    """Each dtype whose causal-attention rate, at its slowest length, is more than ATTENTION_BELOW_MATMUL_MAX
    times below that dtype's matmul rate (a dtype without a matmul figure is not checked)."""
    out = []
    for dtype, pts in sorted(attention.items()):
        peak = matmul.get(dtype, 0.0)
        if not pts or peak <= 0:
            continue
        seq, rate = min(pts, key=lambda p: p[1])
        if rate * ATTENTION_BELOW_MATMUL_MAX < peak:
            out.append(Implausible(
                f"attention_tflops[{dtype}]", rate,
                f"causal attention at {seq} tokens measured {peak / rate:.0f}x below the {dtype} matmul rate "
                f"({peak:.4g} TFLOP/s), more than the {ATTENTION_BELOW_MATMUL_MAX:g}x a quiet machine shows",
                dtype))
    return out


def attention_overrun(run: str, dtype: str, attention_flops: float, attention_s: float,
                      compute_s: float) -> Implausible | None:
    """A calibration run whose attention (``attention_flops``), timed at the profile's rate (``attention_s``),
    takes more than ATTENTION_SHARE_MAX of the run's whole measured compute: the profile's attention rate for
    ``dtype`` (its name in the profile, "float32") is off."""
    if attention_s <= ATTENTION_SHARE_MAX * compute_s:
        return None
    return Implausible(f"attention_tflops[{dtype}]", attention_flops / attention_s / 1e12,
                       f"at that rate run {run}'s attention alone takes {attention_s:.3f} s, over "
                       f"{ATTENTION_SHARE_MAX:.0%} of its whole measured compute {compute_s:.3f} s", dtype)
