"""One bad profile figure: ``megatrain-plan profile`` measures implausible samples again and says so;
``megatrain-plan calibrate`` re-measures the figure it needs or names it with the command that fixes it.
Profiles and timings here are fabricated (no timing asserts): each test has one figure off."""
from __future__ import annotations

import itertools

import pytest

from megatrain.planner.profiling import profile_checks, profiler
from megatrain.planner.profiling.calibration import CalibrationError, ProfileFigureError, RunSample, fit
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.planner.profiling.profile_checks import (ATTENTION_BELOW_MATMUL_MAX, REMEASURE_TRIES, SAMPLE_SPREAD_MAX,
                                                        attention_findings, steady_minimum)

GOOD = {"float32": ((256, 0.02), (1024, 0.03), (4096, 0.035))}
BAD = {"float32": ((256, 0.0016), (1024, 0.03), (4096, 0.035))}      # one length 62x below the matmul rate


def _cpu(**kw: object) -> HardwareProfile:
    base = dict(gpu_name="cpu", gpu_mem_bytes=0, h2d_gbps=5.0, d2h_gbps=5.0, duplex_gbps=5.0,
                matmul_tflops={"float32": 0.1, "bfloat16": 0.01}, cpu_adam_params_per_s=1e9,
                host_ram_bytes=64 << 30, host_available_bytes=60 << 30, cores=2, attention_tflops=GOOD)
    return HardwareProfile(**{**base, **kw})


def _run(name: str, compute_s: float, attention_s: float) -> RunSample:
    return RunSample(name=name, hidden_size=256, params=1, flops=1e12, overhead_units=10, compute_s=compute_s,
                     h2d_bytes=1e9, h2d_s=0.1, d2h_bytes=1e9, d2h_s=0.2, adam_params=1_000_000, adam_s=0.01,
                     step_s=compute_s, baseline_rss_bytes=300_000_000, peak_rss_growth_bytes=0, listed_bytes=0,
                     transient_bytes=0, attention_flops=1e11 if attention_s else 0.0, attention_s=attention_s)


# ---- the checks -----------------------------------------------------------------------------------

def test_a_wide_spread_is_measured_again_and_said() -> None:
    rounds = iter([[1.0, 3.0, 1.2], [2.0, 2.1, 2.05]])  # 200% spread, then 5%
    said: list[str] = []
    assert steady_minimum(lambda: next(rounds), "float32 matmul", said.append) == 2.0
    assert len(said) == 1 and "float32 matmul" in said[0] and "spread 200%" in said[0]
    assert f"{SAMPLE_SPREAD_MAX:.0%} bound" in said[0] and f"(2/{REMEASURE_TRIES})" in said[0]


def test_a_spread_that_stays_keeps_the_steadiest_round_and_says_so() -> None:
    rounds = iter([[1.0, 3.0], [1.5, 2.4], [0.5, 2.0]])  # spreads 200%, 60%, 300%
    said: list[str] = []
    assert steady_minimum(lambda: next(rounds), "x", said.append) == 1.5
    assert len(said) == REMEASURE_TRIES and "still spread 60%" in said[-1]


def test_a_steady_figure_is_measured_once() -> None:
    calls = itertools.count()
    said: list[str] = []
    assert steady_minimum(lambda: [next(calls) + 1.0, 1.1], "x", said.append) == 1.0
    assert next(calls) == 1 and said == []


def test_attention_far_below_matmul_is_implausible() -> None:
    assert attention_findings({"float32": 0.1}, GOOD) == []
    [f] = attention_findings({"float32": 0.1}, BAD)
    assert f.figure == "attention_tflops[float32]" and f.dtype == "float32" and f.value == 0.0016
    assert "256 tokens" in f.reason and "62x below" in f.reason
    # the bound itself: just within it is believed, a dtype without a matmul figure is not checked
    edge = {"float32": ((256, 0.1 / ATTENTION_BELOW_MATMUL_MAX * 1.01),)}
    assert attention_findings({"float32": 0.1}, edge) == [] and attention_findings({}, BAD) == []


# ---- megatrain-plan profile ---------------------------------------------------------------------

def test_profile_measures_implausible_attention_again(monkeypatch) -> None:
    answers = iter([BAD, GOOD])
    monkeypatch.setattr(profiler, "attention_rates", lambda on_gpu, dtypes, log=None: next(answers))
    monkeypatch.setattr(profiler, "matmul_tflops", lambda *a, **k: {"float32": 0.1, "bfloat16": 0.01})
    monkeypatch.setattr(profiler, "cpu_adam_rate", lambda numel, threads: [(1, 1e9)])
    monkeypatch.setattr(profiler, "cpu_shadow_rate", lambda numel: 1e9)
    monkeypatch.setattr(profiler, "cpu_bf16_state_rate", lambda numel, threads, fp32_rate=None: 1e9)
    monkeypatch.setattr(profiler, "cpu_copy_gbps", lambda: 5.0)
    monkeypatch.setattr(profiler, "gpu_present", lambda: False)
    said: list[str] = []
    hw = profiler.measure(None, log=said.append)
    assert dict(hw.attention_tflops) == GOOD and next(answers, None) is None
    assert any("attention_tflops[float32]" in s and "measuring it again (2/" in s for s in said)
    assert "attention_tflops" not in hw.source


def test_profile_keeps_and_names_attention_that_stays_implausible(monkeypatch) -> None:
    calls = itertools.count()
    monkeypatch.setattr(profiler, "attention_rates", lambda on_gpu, dtypes, log=None: (next(calls), BAD)[1])
    said: list[str] = []
    attention, left = profiler.plausible_attention({"float32": 0.1}, dict(BAD), False, said.append)
    assert attention == BAD and [f.figure for f in left] == ["attention_tflops[float32]"]
    assert next(calls) == REMEASURE_TRIES - 1  # measured again until REMEASURE_TRIES measurements in all
    assert "kept after" in said[-1] and "quiet machine" in said[-1]


# ---- megatrain-plan calibrate -------------------------------------------------------------------

def test_fit_names_an_attention_rate_the_runs_contradict() -> None:
    """The case that blamed the per-block overhead: attention at the profile's rate longer than the run."""
    with pytest.raises(ProfileFigureError) as e:
        fit([_run("h256", 0.347, 12.0)], "fp32", overhead_run=_run("overhead", 0.05, 0.001))
    msg = str(e.value)
    assert "attention_tflops[float32]" in msg and "megatrain-plan profile" in msg and "h256" in msg
    assert "overhead" not in msg and "\n" not in msg and e.value.finding.dtype == "float32"
    assert e.value.finding.value == pytest.approx(1e11 / 12.0 / 1e12)  # the rate the profile gave, TFLOP/s
    assert isinstance(e.value, CalibrationError)
    fit([_run("h256", 0.347, 0.1)], "fp32")  # a plausible share fits


def test_calibrate_measures_an_implausible_profile_figure_before_the_runs(monkeypatch) -> None:
    from megatrain.tools import profile_repair

    monkeypatch.setattr(profiler, "attention_rates", lambda on_gpu, dtypes, log=None: GOOD)
    said: list[str] = []
    hw = profile_repair.checked_profile(_cpu(attention_tflops=BAD), "fp32", said.append)
    assert dict(hw.attention_tflops) == GOOD
    assert "attention_tflops[float32]" in said[0] and "before the runs" in said[0]
    untouched = _cpu()
    assert profile_repair.checked_profile(untouched, "fp32", said.append) is untouched


def test_calibrate_refits_once_with_the_figure_measured_again(monkeypatch) -> None:
    from megatrain.tools import profile_repair

    monkeypatch.setattr(profiler, "attention_rates", lambda on_gpu, dtypes, log=None: GOOD)
    seen: list[object] = []

    def fit_once(h: HardwareProfile) -> str:
        seen.append(dict(h.attention_tflops))
        if len(seen) == 1:
            fit([_run("h256", 0.347, 12.0)], "fp32")
        return "fitted"

    said: list[str] = []
    slow = {"float32": ((256, 0.005),)}  # within the bound against matmul, contradicted by the runs
    got, hw, warnings = profile_repair.fit_checked(fit_once, _cpu(attention_tflops=slow), said.append)
    assert got == "fitted" and warnings == [] and seen == [slow, GOOD] and dict(hw.attention_tflops) == GOOD
    assert "measuring it again and fitting once more" in said[0]


def test_calibrate_names_the_figure_and_fits_without_it_when_it_stays_off(monkeypatch) -> None:
    """Measured again and still contradicted by the runs: the fit goes on with the attention inside the layers'
    rate, the figure leaves the profile, and a one-line warning names it with the command that measures it."""
    from megatrain.tools import profile_repair

    monkeypatch.setattr(profiler, "attention_rates", lambda on_gpu, dtypes, log=None: GOOD)
    seen: list[object] = []

    def fit_once(h: HardwareProfile) -> str:
        seen.append(dict(h.attention_tflops))
        if "float32" in h.attention_tflops:  # the runs contradict every attention figure this machine gives
            fit([_run("h256", 0.347, 12.0)], "fp32")
        return "fitted without it"

    got, hw, warnings = profile_repair.fit_checked(fit_once, _cpu(), lambda s: None)
    assert got == "fitted without it" and "float32" not in hw.attention_tflops and seen[-1] == {}
    [w] = warnings
    assert "attention_tflops[float32]" in w and "measured twice" in w and "megatrain-plan profile" in w
    assert "\n" not in w


def test_calibrate_end_to_end_with_a_bad_saved_profile(monkeypatch, tmp_path) -> None:
    """calibrate() with fabricated runs and a saved profile whose attention is off: it measures the figure
    again (fabricated too), fits, and the profile it returns carries the new figure."""
    from megatrain.tools import calibrate

    path = tmp_path / "hw.json"
    path.write_text(_cpu(attention_tflops=BAD).to_json())
    monkeypatch.setattr(profiler, "attention_rates", lambda on_gpu, dtypes, log=None: GOOD)

    def fake_rounds(measurements, rounds, log=lambda r, i: None):
        out = []
        for config, seq, batch, dtype, plan_json, steps, head in measurements:
            scale = config["hidden_size"] / 64
            step = {"step_s": 0.02 * scale ** 2, "h2d_busy_s": 0.001, "d2h_busy_s": 0.001, "adam_busy_s": 0.002}
            out.append({"steps": [step] * steps, "head_s": [0.001 * scale] * head, "cuda": False,
                        "baseline_rss_bytes": 300 << 20, "peak_rss_growth_bytes": 200 << 20})
        return out

    monkeypatch.setattr(calibrate, "run_in_rounds", fake_rounds)
    said: list[str] = []
    hw, out, _ = calibrate.calibrate("fp32", 1, 0.0, True, "test", str(path), said.append, rounds=1)
    assert out == str(path) and dict(hw.attention_tflops) == GOOD and hw.fitted("fp32") is not None
    assert any("before the runs" in s for s in said)
    assert profile_checks.attention_findings(dict(hw.matmul_tflops), hw.attention_tflops) == []


def test_the_disk_probe_measures_a_spread_round_again_and_keeps_a_steady_ones_best(monkeypatch, tmp_path) -> None:
    """disk_bandwidth: a round of passes (each timed as its read plus its write) spread beyond SAMPLE_SPREAD_MAX is
    measured again and said; the steady round's best read and best write are the figures."""
    from megatrain.planner.profiling import host_probe

    passes = iter([(1.0, 2.0), (4.0, 8.0), (1.0, 2.0),        # 1.5 s and 0.375 s per GB: 300% spread
                   (2.0, 4.0), (2.2, 4.1), (2.1, 4.4)])       # within 10%
    monkeypatch.setattr(host_probe, "_disk_pass", lambda *a, **k: next(passes))
    said: list[str] = []
    read, write, direct = host_probe.disk_bandwidth(str(tmp_path), repeats=3, log=said.append)
    assert (read, write) == (2.2, 4.4)
    assert len(said) == 1 and "disk read/write" in said[0] and "spread 300%" in said[0] and "(2/" in said[0]
    assert next(passes, None) is None
