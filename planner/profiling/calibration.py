"""Constants fitted from real training steps: the data the profile stores, and the arithmetic that fits it.

``megatrain-plan calibrate`` (tools/calibrate.py) runs a few steps of small models
through the runtime and hands this module plain numbers per run; nothing here
imports the runtime. The fitted terms replace the cost and memory models'
default constants where a profile carries them:

  achieved rate by width         r(h)  TFLOP/s of the decoder layers' compute (matmuls, elementwise kernels,
                                       attention) at hidden size h; between calibrated widths linear in log2(h);
                                       times eff(t) = t / (t + t_half) for t tokens per micro-batch
  attention                            the layers' causal attention at the profile's measured rate (by
                                       sequence length), apart from r(h), where the profile has that rate
  head rate by width        r_head(h)  the head's shape class (norm, chunked [t, h] x [h, V] and cross-entropy,
                                       forward and backward), timed alone with the runtime's head function
  per-block overhead             o     seconds per decoder layer per micro-batch (forward, recompute and
                                       backward together) that do not scale with FLOPs: launches, Python
  AdamW and copy rates                 as measured inside the step (params/s; GB/s per direction)
  process baseline               P     resident bytes of the process before the engine exists
  activation temporaries         a, b  what the buffers the model lists miss: peak RSS growth - listed bytes
                                       = a + b x (layer working set + logits chunk), allocator slack included
  sparse factor                  s     the routed experts' seconds over what their matmul FLOPs take at r(h)
                                       (routing, gathers and scatters, small per-expert matmuls, the weighted
                                       sum), from one mixture-of-experts run against the dense fit; 1 unfitted

Measurements are robust to a busy machine: each figure is the best of several
samples (the minimum time: what the machine does when nothing else runs), and
its spread (max - min) / min is recorded; a spread above SPREAD_WARN is reported.

Pure stdlib.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from megatrain.errors import MegatrainError

from megatrain.planner.profiling.profile_checks import Implausible, attention_overrun

# A figure whose samples spread by more than this (max / min - 1) was measured on a busy machine.
SPREAD_WARN = 0.25
# A head timed alone at more than this share of its run's compute was measured on a busy machine (the head is
# one block of many): the run's head then counts with its layers.
HEAD_SHARE_MAX = 0.8


class CalibrationError(MegatrainError):
    """Calibration data cannot be used. One line: what, and the fix."""


class ProfileFigureError(CalibrationError):
    """One figure of the hardware profile (``finding.figure``) is off against the runs: measure it again."""

    def __init__(self, finding: Implausible) -> None:
        super().__init__(f"the profile's {finding.line()}; measure it again with megatrain-plan profile on a quiet "
                         "machine, then run megatrain-plan calibrate")
        self.finding = finding


@dataclass(frozen=True)
class Robust:
    """One figure from several samples: the kept value and how far the samples spread."""

    value: float
    spread: float       # (max - min) / min over the samples; 0 for one sample
    samples: int

    @property
    def noisy(self) -> bool:
        return self.spread > SPREAD_WARN


def robust(samples: Sequence[float], percentile: float = 0.0) -> Robust:
    """The ``percentile`` (0: the minimum, 50: the median) of ``samples``, nearest rank, with their spread.

    Times are kept at the minimum by default: on a shared machine other work only ever adds time.
    """
    xs = sorted(float(x) for x in samples)
    if not xs:
        raise CalibrationError("no samples to keep; run more steps (--steps)")
    if not 0.0 <= percentile <= 100.0:
        raise CalibrationError(f"percentile={percentile} must be within 0..100")
    # nearest rank: index = ceil(p / 100 x n) - 1, at least 0
    idx = max(0, math.ceil(percentile / 100.0 * len(xs)) - 1)
    lo = xs[0]
    spread = (xs[-1] - lo) / lo if lo > 0 else 0.0
    return Robust(xs[idx], spread, len(xs))


@dataclass(frozen=True)
class RunSample:
    """One calibration run (one model, one plan), each figure already reduced with ``robust``.

    ``flops``: hardware FLOPs of the step (forward, recompute, backward, head); ``overhead_units``: the
    cost model's count of per-block overheads in the step (decoder-layer-equivalents x micro-batches);
    bytes figures are what one step moves; ``listed_bytes`` is the memory model's sum of the buffers it
    lists (no fixed terms); ``transient_bytes`` its layer working set + logits chunk."""

    name: str
    hidden_size: int
    params: int
    flops: float
    overhead_units: float
    compute_s: float
    h2d_bytes: float
    h2d_s: float
    d2h_bytes: float
    d2h_s: float
    adam_params: int
    adam_s: float
    step_s: float
    baseline_rss_bytes: int
    peak_rss_growth_bytes: int
    listed_bytes: int
    transient_bytes: int
    spread: float = 0.0
    tokens_per_micro_batch: int = 0         # t = micro-batch size x sequence length (0: not known)
    head_flops: float = 0.0                  # the head's FLOPs in the step, and its seconds timed alone
    head_s: float = 0.0                      # (0: not timed; the head then counts with the layers)
    head_units: float = 0.0                  # the head's share of overhead_units
    attention_flops: float = 0.0             # the layers' causal-attention FLOPs in the step, and their seconds
    attention_s: float = 0.0                 # at the profile's measured attention rate (0: not measured; the
                                             # attention then counts with the layers)
    expert_flops: float = 0.0                # the routed experts' matmul FLOPs in the step (0: a dense model)


@dataclass(frozen=True)
class Calibration:
    """Fitted terms for one compute dtype on one machine, with where they came from."""

    compute_dtype: str
    # ((hidden size, achieved TFLOP/s), ...) sorted by hidden size
    tflops_by_width: tuple[tuple[int, float], ...]
    block_overhead_s: float
    adam_params_per_s: float
    h2d_gbps: float
    d2h_gbps: float
    process_bytes: int
    temporaries_bytes: int                   # a: fixed part of what the listed buffers miss
    temporaries_factor: float                # b: per byte of layer working set + logits chunk
    # eff(t) = t / (t + t_half) with t tokens per micro-batch; tflops_by_width holds r(h) at eff = 1, the
    # rate at t is r(h) x eff(t). 0: no dependence on t was measured.
    t_half_tokens: float = 0.0
    # ((hidden size, TFLOP/s), ...) of the head (final norm, chunked lm_head and cross-entropy, forward and
    # backward, timed alone); empty: the head runs at the layers' rate.
    head_tflops_by_width: tuple[tuple[int, float], ...] = ()
    # True: r(h) was fitted without the layers' causal attention, which the cost model then times at the
    # profile's measured attention rate; False: attention is inside r(h).
    attention_apart: bool = False
    # s: the routed experts' time over their matmul FLOPs at the layers' rate (``fit_sparse_factor``); a dense
    # model never reads it; 1.0: not fitted (profiles calibrated before it).
    sparse_factor: float = 1.0
    # where they came from: command, date, runs, samples per figure, the largest spread
    source: str = "unspecified"
    samples: int = 0
    spread: float = 0.0
    runs: tuple[Mapping[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "tflops_by_width",
                           tuple(sorted((int(w), float(r)) for w, r in self.tflops_by_width)))
        object.__setattr__(self, "runs", tuple(dict(r) for r in self.runs))
        object.__setattr__(self, "head_tflops_by_width",
                           tuple(sorted((int(w), float(r)) for w, r in self.head_tflops_by_width)))
        if any(w <= 0 or r <= 0 for w, r in self.head_tflops_by_width):
            raise CalibrationError(f"head_tflops_by_width={self.head_tflops_by_width!r} needs positive (width, "
                                   "TFLOP/s) pairs; run megatrain-plan calibrate again")
        if not self.tflops_by_width or any(w <= 0 or r <= 0 for w, r in self.tflops_by_width):
            raise CalibrationError(f"tflops_by_width={self.tflops_by_width!r} needs positive (width, TFLOP/s) "
                                   "pairs; run megatrain-plan calibrate again")
        for f in ("adam_params_per_s", "h2d_gbps", "d2h_gbps", "sparse_factor"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or v <= 0:
                raise CalibrationError(f"calibration {f}={v!r} must be a positive number; run megatrain-plan "
                                       "calibrate again")
        for f in ("block_overhead_s", "temporaries_factor", "spread", "t_half_tokens"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or v < 0:
                raise CalibrationError(f"calibration {f}={v!r} must be a number >= 0; run megatrain-plan "
                                       "calibrate again")
        if not isinstance(self.attention_apart, bool):
            raise CalibrationError(f"calibration attention_apart={self.attention_apart!r} must be true or false; "
                                   "run megatrain-plan calibrate again")
        for f in ("process_bytes", "temporaries_bytes", "samples"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise CalibrationError(f"calibration {f}={v!r} must be an integer >= 0; run megatrain-plan "
                                       "calibrate again")

    def tflops(self, hidden_size: int) -> float:
        """Achieved TFLOP/s at ``hidden_size``: linear in log2(width) between calibrated widths, the
        nearest calibrated width's figure outside them."""
        return log2_interpolate(self.tflops_by_width, hidden_size)

    def head_tflops(self, hidden_size: int) -> float:
        """The head's TFLOP/s at ``hidden_size``, interpolated as ``tflops``."""
        return log2_interpolate(self.head_tflops_by_width, hidden_size)

    def rate_tflops(self, hidden_size: int, tokens_per_micro_batch: int) -> float:
        """Achieved TFLOP/s at width h and t tokens per micro-batch: r(h) x t / (t + t_half)."""
        t = tokens_per_micro_batch
        return self.tflops(hidden_size) * (t / (t + self.t_half_tokens) if self.t_half_tokens > 0 else 1.0)

    def temporaries(self, transient_bytes: int) -> int:
        """What the listed buffers miss at peak: a + b x (layer working set + logits chunk)."""
        return int(self.temporaries_bytes + self.temporaries_factor * transient_bytes)

    def describe(self) -> str:
        return f"fitted ({self.source})"

    def to_dict(self) -> dict[str, Any]:
        return {"compute_dtype": self.compute_dtype, "tflops_by_width": [list(p) for p in self.tflops_by_width],
                "block_overhead_s": self.block_overhead_s, "adam_params_per_s": self.adam_params_per_s,
                "h2d_gbps": self.h2d_gbps, "d2h_gbps": self.d2h_gbps, "process_bytes": self.process_bytes,
                "temporaries_bytes": self.temporaries_bytes, "temporaries_factor": self.temporaries_factor,
                "t_half_tokens": self.t_half_tokens,
                "head_tflops_by_width": [list(p) for p in self.head_tflops_by_width],
                "attention_apart": self.attention_apart, "sparse_factor": self.sparse_factor, "source": self.source,
                "samples": self.samples, "spread": self.spread,
                "runs": [dict(r) for r in self.runs]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Calibration":
        if not isinstance(data, Mapping):
            raise CalibrationError(f"calibration is a JSON object, got {type(data).__name__}; run "
                                   "megatrain-plan calibrate again")
        try:
            return cls(**{**data, "tflops_by_width": tuple(tuple(p) for p in data.get("tflops_by_width", ())),
                          "head_tflops_by_width": tuple(tuple(p) for p in data.get("head_tflops_by_width", ()))})
        except TypeError as e:
            raise CalibrationError(f"calibration has a missing, unknown or mistyped field ({e}); run "
                                   "megatrain-plan calibrate again") from None


def log2_interpolate(pts: Sequence[tuple[int, float]], x: int) -> float:
    """r at x from (x, r) points sorted by x (widths, sequence lengths): linear in log2(x) between them,
    the end figures outside."""
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, r0), (x1, r1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            # r = r0 + (r1 - r0) x (log2 x - log2 x0) / (log2 x1 - log2 x0)
            f = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
            return r0 + (r1 - r0) * f
    raise AssertionError("unreachable: points are sorted")


# ---- fitting ---------------------------------------------------------------------------------

def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares y = a + b x; b is clamped at 0 (a term that shrinks with x is noise here)
    and a at 0, each refitted with the other fixed. One point (or all x equal): a = mean(y), b = 0."""
    n = len(xs)
    if n == 0:
        raise CalibrationError("no runs to fit; run megatrain-plan calibrate with at least one model")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if n == 1 or sxx == 0:
        return max(0.0, my), 0.0
    # b = sum((x - mx)(y - my)) / sum((x - mx)^2); a = my - b mx
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    if b < 0:
        return max(0.0, my), 0.0
    a = my - b * mx
    if a < 0:
        # through the origin: b = sum(x y) / sum(x^2)
        return 0.0, max(0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs))
    return a, b


def _head_timed(r: RunSample) -> bool:
    """Whether the run's head was timed alone usably: one as long as the whole step was on a busy machine."""
    return 0 < r.head_s < HEAD_SHARE_MAX * r.compute_s


def _body(r: RunSample) -> tuple[float, float, float]:
    """(FLOPs, seconds, overhead units) of the run without its head where the head was timed alone, and
    without its attention where the profile measured the attention rate."""
    flops, seconds = r.flops - r.attention_flops, r.compute_s - r.attention_s
    if _head_timed(r):
        return flops - r.head_flops, seconds - r.head_s, r.overhead_units - r.head_units
    return flops, seconds, r.overhead_units


def fit_sparse_factor(run: RunSample, cal: Calibration) -> float:
    """s from a mixture-of-experts run and the dense fit ``cal``: the run's compute (less head, attention and
    o x units, as ``fit`` takes them off) = (flops - expert flops) / r + s x expert flops / r, r = r(h) x eff(t)
    -> s = (pure x r - (flops - expert flops)) / expert flops."""
    if run.expert_flops <= 0:
        raise CalibrationError(f"run {run.name} has no expert FLOPs; the sparse run needs a mixture-of-experts model")
    flops, seconds, units = _body(run)
    pure, rate = seconds - cal.block_overhead_s * units, cal.rate_tflops(run.hidden_size, run.tokens_per_micro_batch)
    s = (pure * rate * 1e12 - (flops - run.expert_flops)) / run.expert_flops
    if s <= 0:
        raise CalibrationError(f"run {run.name}: its compute ({run.compute_s:.3f} s) is less than its dense terms "
                               "alone (a busy machine during the dense runs?); run megatrain-plan calibrate again")
    return s


def fit(runs: Sequence[RunSample], compute_dtype: str, overhead_run: RunSample | None = None,
        source: str = "unspecified", samples: int = 0, sparse_run: RunSample | None = None) -> Calibration:
    """Fit every term from the runs (see the module docstring for the model).

    attention where the profile measured causal attention, its seconds at that rate come off each run's compute
              and its FLOPs off the run's FLOPs (``attention_apart``)
    head      where a run timed its head alone: r_head(h) = head FLOPs / head seconds, and the run's own
              FLOPs, seconds and overhead units below are without the head
    overhead  o = (compute_s - flops / r) / units of ``overhead_run`` (a model so small that FLOPs hardly
                count), with r the rate of the narrowest run measured without overhead; else 0
    rate      r = flops / (compute_s - o x units) / 1e12 per run; t_half from runs of one width at two
              micro-batch sizes (``fit_t_half``); r(h) = median over the width's runs of r / eff(t)
    AdamW     sum(params) / sum(adam_s); copies: sum(bytes) / sum(s) / 1e9 per direction
    process   P = the median baseline RSS (imports done, no engine yet: the same in every run)
    temps     growth - listed = a + b x transient, by ``fit_line``
    sparse    s by ``fit_sparse_factor`` from ``sparse_run`` (a mixture of experts, in no other term), else 1
    """
    if not runs:
        raise CalibrationError("no runs to fit; run megatrain-plan calibrate with at least one model")
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(compute_dtype, compute_dtype)
    for r in [*runs, *(x for x in (overhead_run, sparse_run) if x is not None)]:
        if (off := attention_overrun(r.name, dtype, r.attention_flops, r.attention_s, r.compute_s)) is not None:
            raise ProfileFigureError(off)

    o = 0.0
    if overhead_run is not None and _body(overhead_run)[2] > 0:
        nf, ns, _ = _body(min(runs, key=lambda r: r.hidden_size))
        r0 = nf / ns                                           # FLOP/s with the overhead still inside
        of, os_, ou = _body(overhead_run)
        o = max(0.0, (os_ - of / r0) / ou)
    by_width: dict[int, list[tuple[int, float]]] = {}     # width -> [(t, TFLOP/s)]
    heads: dict[int, list[float]] = {}                    # width -> [head TFLOP/s]
    for r in runs:
        if _head_timed(r):
            heads.setdefault(r.hidden_size, []).append(r.head_flops / r.head_s / 1e12)
        flops, seconds, units = _body(r)
        pure = seconds - o * units
        if pure <= 0:
            raise CalibrationError(f"run {r.name}: the per-block overhead fitted from the overhead run ({o * 1e3:.2f} "
                                   f"ms x {units:g}) exceeds its compute without attention and head ({seconds:.3f} "
                                   f"s of {r.compute_s:.3f} s); calibrate with larger models")
        by_width.setdefault(r.hidden_size, []).append((r.tokens_per_micro_batch, flops / pure / 1e12))
    t_half = statistics.median(halves) if (halves := [fit_t_half(v) for v in by_width.values()
                                                        if len({t for t, _ in v if t > 0}) >= 2]) else 0.0
    # r(h) = median over the width's runs of rate / eff(t)
    rates = tuple((w, statistics.median(x / (t / (t + t_half) if t_half > 0 and t > 0 else 1.0) for t, x in v))
                  for w, v in by_width.items())

    def rate(num: float, den: float, what: str) -> float:
        if den <= 0 or num <= 0:
            raise CalibrationError(f"no {what} time was measured in the runs; check the runtime's step "
                                   "breakdown")
        return num / den

    adam = rate(sum(r.adam_params for r in runs), sum(r.adam_s for r in runs), "AdamW")
    h2d = rate(sum(r.h2d_bytes for r in runs), sum(r.h2d_s for r in runs), "H2D copy") / 1e9
    d2h = rate(sum(r.d2h_bytes for r in runs), sum(r.d2h_s for r in runs), "D2H copy") / 1e9
    all_runs = list(runs) + ([overhead_run] if overhead_run is not None else [])
    process = statistics.median(r.baseline_rss_bytes for r in all_runs)
    a, b = fit_line([r.transient_bytes for r in all_runs],
                    [r.peak_rss_growth_bytes - r.listed_bytes for r in all_runs])
    cal = Calibration(
        compute_dtype=compute_dtype, tflops_by_width=rates, block_overhead_s=o, adam_params_per_s=adam,
        h2d_gbps=h2d, d2h_gbps=d2h, process_bytes=int(process), temporaries_bytes=int(round(a)),
        temporaries_factor=b, t_half_tokens=t_half,
        head_tflops_by_width=tuple((w, statistics.median(v)) for w, v in heads.items()),
        attention_apart=any(r.attention_s > 0 for r in runs), source=source,
        samples=samples, spread=max(r.spread for r in all_runs),
        runs=tuple(_run_row(r) for r in all_runs))
    if sparse_run is None:
        return cal
    return dataclasses.replace(cal, sparse_factor=fit_sparse_factor(sparse_run, cal),
                               spread=max(cal.spread, sparse_run.spread), runs=(*cal.runs, _run_row(sparse_run)))


def fit_t_half(points: Sequence[tuple[int, float]]) -> float:
    """t_half of eff(t) = t / (t + t_half) from the rates at the smallest and largest t of one width:
    q = (r1 / r2) x (t2 / t1) = (t2 + th) / (t1 + th)  ->  th = (t2 - q t1) / (q - 1); 0 when the rate
    does not rise with t (q <= 1 or th < 0), at most MAX_T_HALF."""
    known = sorted((t, r) for t, r in points if t > 0)
    (t1, r1), (t2, r2) = known[0], known[-1]
    q = r1 / r2 * t2 / t1
    if q <= 1.0 + 1e-9 or t1 == t2:
        return 0.0
    return min(MAX_T_HALF, max(0.0, (t2 - q * t1) / (q - 1.0)))


MAX_T_HALF = 4096.0


def _run_row(r: RunSample) -> dict[str, Any]:
    return {"name": r.name, "hidden_size": r.hidden_size, "params": r.params, "step_s": r.step_s,
            "compute_s": r.compute_s, "peak_rss_growth_bytes": r.peak_rss_growth_bytes,
            "listed_bytes": r.listed_bytes, "spread": r.spread}
