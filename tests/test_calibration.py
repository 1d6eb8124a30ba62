"""Fitted constants: the fitting arithmetic by hand, robust sampling, the profile round trip, and the cost
and memory models using fitted terms where a profile has them (defaults otherwise)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from megatrain.planner.costs import cost_model, memory_model, step_traffic
from megatrain.planner.shapes import model_shapes
from megatrain.planner.profiling.calibration import (SPREAD_WARN, Calibration, CalibrationError, RunSample, fit,
                                                     fit_line, fit_sparse_factor, fit_t_half, robust)
from megatrain.planner.profiling.hardware import HardwareError, HardwareProfile
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload

MB = 1e6
SMALL = model_shapes.from_config(dict(model_type="llama", vocab_size=1000, hidden_size=512, intermediate_size=1024,
                                      num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4))


def _cpu(**kw: object) -> HardwareProfile:
    base = dict(gpu_name="cpu", gpu_mem_bytes=0, h2d_gbps=5.0, d2h_gbps=5.0, duplex_gbps=5.0,
                matmul_tflops={"float32": 0.1, "bfloat16": 0.01}, cpu_adam_params_per_s=1e9,
                host_ram_bytes=64 << 30, host_available_bytes=60 << 30, cores=2)
    return HardwareProfile(**{**base, **kw})


def _cal(**kw: object) -> Calibration:
    base = dict(compute_dtype="fp32", tflops_by_width=((256, 0.1), (1024, 0.3)), block_overhead_s=2e-3,
                adam_params_per_s=5e8, h2d_gbps=8.0, d2h_gbps=4.0, process_bytes=300_000_000,
                temporaries_bytes=50_000_000, temporaries_factor=0.5, source="test calibration", samples=3,
                spread=0.1)
    return Calibration(**{**base, **kw})


def _run(name: str, h: int, flops: float, units: float, compute_s: float, **kw: object) -> RunSample:
    base = dict(name=name, hidden_size=h, params=1, flops=flops, overhead_units=units, compute_s=compute_s,
                h2d_bytes=1e9, h2d_s=0.1, d2h_bytes=1e9, d2h_s=0.2, adam_params=1_000_000, adam_s=0.01,
                step_s=compute_s, baseline_rss_bytes=300_000_000, peak_rss_growth_bytes=0, listed_bytes=0,
                transient_bytes=0)
    return RunSample(**{**base, **kw})


# ---- robust sampling ----------------------------------------------------------------------------

def test_robust_keeps_the_fastest_and_records_the_spread() -> None:
    r = robust([1.5, 1.0, 1.2, 2.0])
    assert (r.value, r.spread, r.samples) == (1.0, 1.0, 4)          # spread = (2.0 - 1.0) / 1.0
    assert r.noisy
    assert robust([1.0, 1.1, 1.05]).noisy is False                   # 10% < SPREAD_WARN
    assert robust([1.0, 1.0 + SPREAD_WARN + 0.01]).noisy


def test_robust_percentile_is_nearest_rank() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert robust(xs, 50).value == 2.0     # ceil(0.5 x 4) - 1 = index 1 of [1, 2, 3, 4]
    assert robust(xs, 75).value == 3.0
    assert robust(xs, 100).value == 4.0
    assert robust([7.0]).spread == 0.0
    with pytest.raises(CalibrationError, match="no samples"):
        robust([])
    with pytest.raises(CalibrationError, match="percentile"):
        robust([1.0], 101)


# ---- fitting arithmetic -------------------------------------------------------------------------

def test_fit_line_by_hand() -> None:
    assert fit_line([1, 2, 3], [3, 5, 7]) == pytest.approx((1.0, 2.0))
    assert fit_line([1, 2, 3], [7, 5, 3]) == pytest.approx((5.0, 0.0))     # falling: mean, no slope
    # y = 2x - 1 would need a < 0: through the origin instead, b = sum(xy) / sum(x^2) = (1+6+15) / 14
    assert fit_line([1, 2, 3], [1, 3, 5]) == pytest.approx((0.0, 22 / 14))
    assert fit_line([4], [9]) == (9.0, 0.0)
    with pytest.raises(CalibrationError):
        fit_line([], [])


def test_fit_by_hand() -> None:
    # narrow run: 1e12 FLOPs in 10.5 s with 100 overhead units -> r0 = 1e12 / 10.5 FLOP/s with overhead inside
    narrow = _run("a", 256, 1e12, 100, 10.5, baseline_rss_bytes=300 * MB, peak_rss_growth_bytes=int(150 * MB),
                  listed_bytes=int(100 * MB), transient_bytes=int(100 * MB), adam_params=1_000_000, adam_s=0.01,
                  h2d_bytes=1e9, h2d_s=0.1, d2h_bytes=1e9, d2h_s=0.2)
    wide = _run("b", 512, 4e12, 100, 20.21, baseline_rss_bytes=320 * MB, peak_rss_growth_bytes=int(350 * MB),
                listed_bytes=int(200 * MB), transient_bytes=int(200 * MB), adam_params=3_000_000, adam_s=0.03,
                h2d_bytes=3e9, h2d_s=0.3, d2h_bytes=3e9, d2h_s=0.6, spread=0.4)
    # overhead run: 0.2205 s = 1e9 / r0 (0.0105 s) + 100 x o  ->  o = 2.1 ms
    tiny = _run("o", 64, 1e9, 100, 0.2205, baseline_rss_bytes=310 * MB, peak_rss_growth_bytes=int(50 * MB),
                listed_bytes=0, transient_bytes=0)
    cal = fit([narrow, wide], "fp32", overhead_run=tiny, source="hand", samples=3)
    assert cal.block_overhead_s == pytest.approx(2.1e-3)
    # r = flops / (compute - o x units): 1e12 / 10.29 s and 4e12 / 20 s
    assert dict(cal.tflops_by_width) == pytest.approx({256: 1 / 10.29, 512: 0.2})
    assert cal.adam_params_per_s == pytest.approx(4e6 / 0.04)
    assert cal.h2d_gbps == pytest.approx(10.0) and cal.d2h_gbps == pytest.approx(5.0)
    assert cal.process_bytes == 310 * MB                           # median of 300, 320, 310 MB
    # growth - listed = 50, 150, 50 MB at transients 100, 200, 0 MB; least squares by hand:
    # mean x = 100 MB, mean y = 250/3 MB, b = (0 + 100 x 200/3 + (-100) x (-100/3)) MB^2 / 20000 MB^2 = 0.5,
    # a = 250/3 - 0.5 x 100 = 100/3 MB
    xs, ys = [100 * MB, 200 * MB, 0], [50 * MB, 150 * MB, 50 * MB]
    mx, my = sum(xs) / 3, sum(ys) / 3
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    assert cal.temporaries_factor == pytest.approx(b) == pytest.approx(0.5)
    assert cal.temporaries_bytes == pytest.approx(my - b * mx, abs=1) == pytest.approx(100 / 3 * MB, abs=1)
    assert cal.spread == 0.4 and cal.samples == 3 and cal.source == "hand"


def test_t_half_by_hand() -> None:
    # truth: r_inf = 0.1, t_half = 256 -> eff(256) = 0.5, eff(1024) = 0.8: rates 0.05 and 0.08
    # q = (0.05 / 0.08) x (1024 / 256) = 2.5; t_half = (1024 - 2.5 x 256) / 1.5 = 256
    assert fit_t_half([(1024, 0.08), (256, 0.05)]) == pytest.approx(256)
    assert fit_t_half([(256, 0.08), (1024, 0.08)]) == 0.0          # no rise with t: no dependence
    assert fit_t_half([(256, 0.09), (1024, 0.08)]) == 0.0
    runs = [_run("a", 512, 1e12, 0, 1e12 / 0.05e12, tokens_per_micro_batch=256),
            _run("b", 512, 1e12, 0, 1e12 / 0.08e12, tokens_per_micro_batch=1024),
            _run("c", 1024, 1e12, 0, 1e12 / 0.16e12, tokens_per_micro_batch=1024)]
    cal = fit(runs, "fp32")
    assert cal.t_half_tokens == pytest.approx(256)
    # r(h) at eff = 1: 0.05 / 0.5 and 0.08 / 0.8 -> 0.1; 0.16 / 0.8 = 0.2
    assert dict(cal.tflops_by_width) == pytest.approx({512: 0.1, 1024: 0.2})
    assert cal.rate_tflops(1024, 768) == pytest.approx(0.2 * 768 / 1024)


def test_fit_with_the_head_timed_alone_by_hand() -> None:
    # 5e12 FLOPs in 30 s, of which the head's 1e12 took 5 s alone: head 0.2 TFLOP/s, layers 4e12 / 25 s
    run = _run("a", 512, 5e12, 100, 30.0, head_flops=1e12, head_s=5.0, head_units=20)
    cal = fit([run], "fp32")
    assert dict(cal.head_tflops_by_width) == pytest.approx({512: 0.2})
    assert dict(cal.tflops_by_width) == pytest.approx({512: 0.16})
    # overhead run (head not timed): o = (2.5 s - 1e9 / (4e12 / 25 s)) / 100 units, from the layers' rate
    tiny = _run("o", 64, 1e9, 100, 2.5)
    cal = fit([run], "fp32", overhead_run=tiny)
    o = (2.5 - 1e9 / (4e12 / 25)) / 100
    assert cal.block_overhead_s == pytest.approx(o)
    assert dict(cal.tflops_by_width) == pytest.approx({512: 4e12 / (25 - o * 80) / 1e12})
    assert Calibration.from_dict(cal.to_dict()) == cal
    # a head timed alone as long as its whole run (a busy machine) is not used: the run counts as one class
    busy = fit([_run("a", 512, 5e12, 100, 30.0, head_flops=1e12, head_s=29.0, head_units=20)], "fp32")
    assert busy.head_tflops_by_width == () and dict(busy.tflops_by_width) == pytest.approx({512: 5 / 30})


def test_fit_refuses_overhead_larger_than_compute() -> None:
    narrow = _run("a", 256, 1e12, 1000, 1.0)
    tiny = _run("o", 64, 1e6, 10, 5.0)
    with pytest.raises(CalibrationError, match="overhead"):
        fit([narrow], "fp32", overhead_run=tiny)


def test_rate_interpolates_in_log_width_and_clamps() -> None:
    cal = _cal()
    assert cal.tflops(512) == pytest.approx(0.2)        # log2 512 is halfway between 256 and 1024
    assert cal.tflops(128) == 0.1 and cal.tflops(4096) == 0.3
    assert cal.temporaries(100) == 50_000_050


# ---- the profile --------------------------------------------------------------------------------

def test_profile_round_trips_the_calibration_with_its_source(tmp_path) -> None:
    hw = _cpu(calibrations=(_cal(runs=({"name": "h256", "step_s": 1.0},)),))
    path = tmp_path / "hw.json"
    hw.save(str(path))
    back = HardwareProfile.load(str(path))
    assert back == hw
    cal = back.fitted("fp32")
    assert cal.source == "test calibration" and cal.spread == 0.1 and cal.samples == 3
    assert cal.runs == ({"name": "h256", "step_s": 1.0},)
    assert json.loads(path.read_text())["calibrations"][0]["tflops_by_width"] == [[256, 0.1], [1024, 0.3]]
    # a second dtype joins the first; calibrating a dtype again replaces its entry
    both = back.with_calibration(_cal(compute_dtype="bf16", source="bf16 run"))
    assert both.fitted("bf16").source == "bf16 run" and both.fitted("float32").source == "test calibration"
    again = both.with_calibration(_cal(source="newer"))
    assert len(again.calibrations) == 2 and again.fitted("fp32").source == "newer"


def test_a_profile_without_calibration_still_loads(tmp_path) -> None:
    data = _cpu().to_dict()
    del data["calibrations"]                                # written before calibration existed
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    hw = HardwareProfile.load(str(path))
    assert hw.calibrations == () and hw.fitted("fp32") is None
    assert "defaults" in hw.constants("fp32")


def test_a_bad_calibration_is_one_line() -> None:
    data = _cpu(calibrations=(_cal(),)).to_dict()
    data["calibrations"][0]["h2d_gbps"] = -1
    with pytest.raises(HardwareError, match="h2d_gbps") as e:
        HardwareProfile.from_dict(data)
    assert "\n" not in str(e.value)
    data["calibrations"] = [{"compute_dtype": "fp32"}]
    with pytest.raises(HardwareError, match="calibrate again"):
        HardwareProfile.from_dict(data)


# ---- the models use fitted terms ----------------------------------------------------------------

def test_cost_model_uses_fitted_terms_on_a_cpu() -> None:
    cal = _cal(t_half_tokens=256.0)
    hw = _cpu(calibrations=(cal,))
    work = Workload(seq_len=128, batch=4, compute_dtype="fp32")
    plan = Plan(micro_batch_size=2)
    est = cost_model.estimate(SMALL, work, plan, hw)
    L, T = SMALL.num_layers, work.tokens
    # h = 512: halfway in log2 between 256 and 1024 -> 0.2; t = 256 tokens: eff = 256 / (256 + 256)
    rate = 0.2e12 * 0.5
    units = cost_model.overhead_units(SMALL, work, plan)
    M, chunks = 2, 1
    assert units == pytest.approx((M + L * M) * 0.25 / 0.9 + (M * chunks + L * M + M) * 0.65 / 0.9)
    h2d, d2h = step_traffic.traffic(SMALL, work, plan)
    E, Lw, H = SMALL.numel_embedding, SMALL.numel_layer, SMALL.numel_head
    assert (h2d, d2h) == ((E + 2 * L * Lw + H) * 4, (L * Lw + E + H) * 4)
    lat = cost_model.COPY_LATENCY_S
    # CPU: everything in series; loads: E, L layers, head forward + L layers backward; drains: head, L, E
    expected = (T * SMALL.hardware_flops_per_token(128) / rate + 2e-3 * units
                + h2d / 8e9 + (2 * L + 2) * lat + d2h / 4e9 + (L + 2) * lat + SMALL.numel_total / 5e8)
    assert est.step_seconds == pytest.approx(expected, rel=1e-9)
    assert est.optimizer_exposed_seconds == pytest.approx(SMALL.numel_total / 5e8)
    assert est.constants == "fitted (test calibration)" and est.to_dict()["constants"] == est.constants


def test_attention_runs_at_its_measured_rate_by_hand() -> None:
    """Defaults: a layer visit's FLOPs less its attention at the layers' rate, the attention at the measured
    rate for the sequence length (linear in log2(seq) between measured lengths)."""
    work = Workload(seq_len=512, batch=2, compute_dtype="fp32")
    plan = Plan(micro_batch_size=2)
    plain = cost_model.estimate(SMALL, work, plan, _cpu())
    measured = _cpu(attention_tflops={"float32": [[256, 0.02], [1024, 0.06]]})
    assert measured.attention_rate_tflops("fp32", 512) == pytest.approx(0.04)      # halfway in log2
    assert measured.attention_rate_tflops("fp32", 8192) == 0.06 and _cpu().attention_rate_tflops("fp32", 512) is None
    assert measured.attention_rate_tflops("bf16", 512) is None
    est = cost_model.estimate(SMALL, work, plan, measured)
    T, L, t = work.tokens, SMALL.num_layers, 1024
    rate = 0.1e12 * t / (t + cost_model.T_HALF_TOKENS) / cost_model.NONMATMUL_FACTOR["cpu"]
    # attention of forward, recompute and backward: T x L x a_fwd x (2 + 2.5)
    attention = T * L * SMALL.attention_flops_fwd(512) * 4.5
    assert step_traffic.hardware_attention_flops(SMALL, work) == pytest.approx(attention)
    assert est.step_seconds - plain.step_seconds == pytest.approx(attention / 0.04e12 - attention / rate)


def test_fit_takes_the_attention_out_of_the_layer_rate_by_hand() -> None:
    # 4e12 FLOPs in 21 s, 1e12 of them attention timed at the profile's rate in 1 s: r = 3e12 / 20 s
    run = _run("a", 512, 4e12, 0, 21.0, attention_flops=1e12, attention_s=1.0)
    cal = fit([run], "fp32", source="hand", samples=1)
    assert dict(cal.tflops_by_width) == pytest.approx({512: 0.15}) and cal.attention_apart
    assert not fit([_run("a", 512, 4e12, 0, 21.0)], "fp32").attention_apart
    # the cost model times attention apart only for a calibration fitted that way
    work = Workload(seq_len=512, batch=2, compute_dtype="fp32")
    plan = Plan(micro_batch_size=2)
    rates = {"float32": [[512, 0.05]]}
    inside = cost_model.estimate(SMALL, work, plan, _cpu(calibrations=(_cal(),), attention_tflops=rates))
    assert inside.step_seconds == cost_model.estimate(SMALL, work, plan, _cpu(calibrations=(_cal(),))).step_seconds
    apart = cost_model.estimate(SMALL, work, plan, _cpu(calibrations=(_cal(attention_apart=True),),
                                                        attention_tflops=rates))
    attention = step_traffic.hardware_attention_flops(SMALL, work)
    assert apart.step_seconds - inside.step_seconds == pytest.approx(attention / 0.05e12 - attention / 0.2e12)


def test_a_bad_attention_rate_is_one_line() -> None:
    for bad in ({"float32": [[512, 0]]}, {"float32": []}, {"float32": [[512]]}, [[512, 1.0]]):
        with pytest.raises(HardwareError, match="attention_tflops") as e:
            _cpu(attention_tflops=bad)
        assert "\n" not in str(e.value)
    with pytest.raises(CalibrationError, match="attention_apart"):
        _cal(attention_apart="yes")


def test_cost_model_uses_the_fitted_head_rate() -> None:
    cal = _cal(head_tflops_by_width=((256, 0.05), (1024, 0.2)))
    work = Workload(seq_len=128, batch=4, compute_dtype="fp32")
    plan = Plan(micro_batch_size=2)
    with_head = cost_model.estimate(SMALL, work, plan, _cpu(calibrations=(cal,)))
    without = cost_model.estimate(SMALL, work, plan, _cpu(calibrations=(_cal(),)))
    T, F_head = work.tokens, SMALL.head_flops_fwd() + SMALL.head_flops_bwd()
    # the head: T x F_head / r_head(512) (0.05 + 0.15 x 0.5 = 0.125 TFLOP/s) instead of T x F_head / r(512)
    # plus its launches (M x chunks x b x o)
    old_head = T * F_head / 0.2e12 + 2e-3 * cost_model.head_overhead_units(SMALL, work, plan)
    assert with_head.step_seconds - without.step_seconds == pytest.approx(T * F_head / 0.125e12 - old_head)


def test_cost_model_keeps_defaults_for_another_dtype() -> None:
    work = Workload(seq_len=128, batch=4, compute_dtype="bf16")
    plan = Plan(micro_batch_size=2)
    fitted = cost_model.estimate(SMALL, work, plan, _cpu(calibrations=(_cal(),)))
    plain = cost_model.estimate(SMALL, work, plan, _cpu())
    assert fitted.step_seconds == plain.step_seconds
    assert "calibrated for fp32 only" in fitted.constants and "defaults" in plain.constants


def test_memory_model_uses_fitted_fixed_terms() -> None:
    work = Workload(seq_len=128, batch=4, compute_dtype="fp32")
    plan = Plan(micro_batch_size=2)
    calibrated = _cpu(calibrations=(_cal(),))
    fitted = {c.name: c.nbytes for c in memory_model.estimate(SMALL, work, plan, calibrated).components}
    plain = {c.name: c.nbytes for c in memory_model.estimate(SMALL, work, plan, _cpu()).components}
    assert plain["process"] == memory_model.HOST_PROCESS_BYTES_CPU and "temporaries" not in plain
    assert fitted["process"] == 300_000_000
    # transient = t x w + layer x c + chunk x V x (c + 12), t = 2 x 128, chunk = min(loss chunk, t) = 256
    t = 256
    transient = t * SMALL.layer_working_bytes_per_token("fp32") + SMALL.numel_layer * 4 + t * 1000 * 16
    assert memory_model.transient_bytes(SMALL, work, plan) == transient
    assert fitted["temporaries"] == int(50_000_000 + 0.5 * transient)
    # every buffer of the runtime is unchanged: fitted terms come on top
    assert {k: v for k, v in fitted.items() if k not in memory_model.FIXED_TERMS} == \
        {k: v for k, v in plain.items() if k not in memory_model.FIXED_TERMS}


# ---- the command --------------------------------------------------------------------------------

def test_calibrate_refuses_bad_input_in_one_line(tmp_path) -> None:
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    for args, needle in ((["--dtype", "fp8"], "--dtype"), (["--out", str(tmp_path)], "directory"),
                         (["--steps", "0"], "--steps"), (["--rounds", "0"], "--rounds"),
                         (["--out", str(notes)], "not a hardware profile")):
        p = subprocess.run([sys.executable, "-m", "megatrain.planner.commands.cli", "calibrate", *args],
                           capture_output=True, text=True)
        assert p.returncode == 2, p.stderr
        assert needle in p.stderr and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert notes.read_text() == '{"mine": 1}'                        # never overwritten


def test_rounds_run_every_model_once_per_round_and_pool_their_samples(monkeypatch) -> None:
    """Round by round (a, b, a, b), never a model's rounds back to back; steps and head timings of all rounds
    pooled in round order, memory figures from the first round."""
    from megatrain.tools import calibrate

    calls: list[tuple[str, int]] = []

    def fake_run_model(config, seq, batch, dtype, plan_json, steps, head_samples=0):
        calls.append((config["name"], steps))
        k = len(calls)
        return {"steps": [{"step_s": float(k)}] * steps, "head_s": [k / 10] * head_samples,
                "peak_rss_bytes": 1000 * k, "baseline_rss_bytes": 10 * k}

    monkeypatch.setattr(calibrate, "run_model", fake_run_model)
    logged: list[tuple[int, int]] = []
    measurements = [({"name": "a"}, 16, 1, "fp32", "{}", 2, 1), ({"name": "b"}, 16, 1, "fp32", "{}", 1, 0)]
    got = calibrate.run_in_rounds(measurements, 3, lambda r, i: logged.append((r, i)))
    assert calls == [("a", 2), ("b", 1)] * 3
    assert logged == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [s["step_s"] for s in got[0]["steps"]] == [1.0, 1.0, 3.0, 3.0, 5.0, 5.0]
    assert got[0]["head_s"] == [0.1, 0.3, 0.5] and got[1]["head_s"] == []
    assert [s["step_s"] for s in got[1]["steps"]] == [2.0, 4.0, 6.0]
    assert got[0]["peak_rss_bytes"] == 1000 and got[1]["baseline_rss_bytes"] == 20
    with pytest.raises(calibrate.CalibrateError, match="--rounds"):
        calibrate.run_in_rounds([], 0)


def test_a_measured_run_reduces_to_a_sample() -> None:
    """The driver against the real runtime: one tiny run in this process, its breakdown keys, a sample."""
    from megatrain.tools import calibrate

    name, config, seq, batch, mbs = calibrate.OVERHEAD_RUN
    plan = Plan(micro_batch_size=mbs)
    measured = calibrate.child({"config": config, "seq": seq, "batch": batch, "dtype": "fp32",
                                "plan": plan.to_json(indent=None), "steps": 2, "head_samples": 2})
    assert len(measured["steps"]) == 2 and measured["baseline_rss_bytes"] > 0
    s = calibrate.reduce_run(name, config, seq, batch, "fp32", plan, measured, _cpu(), 0.0)
    shape = model_shapes.from_config(config)
    assert s.params == shape.params and s.flops == shape.hardware_flops_per_token(seq) * seq * batch
    assert s.overhead_units == cost_model.overhead_units(shape, Workload(seq, batch, "fp32"), plan)
    assert s.step_s > 0 and 0 < s.compute_s <= s.step_s and s.h2d_s > 0 and s.d2h_s > 0
    assert s.adam_params == shape.numel_total and s.adam_s > 0
    assert len(measured["head_s"]) == 2 and s.head_s == min(measured["head_s"]) > 0
    assert s.head_flops == (shape.head_flops_fwd() + shape.head_flops_bwd()) * seq * batch
    assert math.isfinite(s.spread)


def test_the_sparse_run_reduces_with_its_routed_experts_flops() -> None:
    """The sparse run's sample counts its routed experts' matmuls (forward, recompute, backward: 4 x forward) by
    hand: L x 4 x 2 x top-k x 3 x h x I x tokens; the dense runs count none."""
    from megatrain.tools import calibrate

    name, config, seq, batch, mbs = calibrate.SPARSE_RUN
    step = {"step_s": 2.0, "compute_s": 1.5, "h2d_busy_s": 0.1, "d2h_busy_s": 0.1, "adam_busy_s": 0.2}
    measured = {"steps": [step], "baseline_rss_bytes": 1, "peak_rss_growth_bytes": 1, "cuda": False}
    s = calibrate.reduce_run(name, config, seq, batch, "fp32", Plan(micro_batch_size=mbs), measured, _cpu(), 0.0)
    h, i, k, layers = (config[f] for f in ("hidden_size", "moe_intermediate_size", "num_experts_per_tok",
                                           "num_hidden_layers"))
    assert s.expert_flops == layers * 4 * 2 * k * 3 * h * i * seq * batch > 0
    name, config, seq, batch, mbs = calibrate.RUNS[0]
    dense = calibrate.reduce_run(name, config, seq, batch, "fp32", Plan(micro_batch_size=mbs), measured, _cpu(), 0.0)
    assert dense.expert_flops == 0.0


def test_the_planner_reads_fitted_terms_without_the_runtime() -> None:
    code = ("import sys; from megatrain.planner.profiling import calibration, hardware; "
            "from megatrain.planner.commands import cli; from megatrain.planner.costs import cost_model, memory_model; "
            "print(sorted(m for m in sys.modules if m.startswith(('megatrain.runtime', 'megatrain.tools', 'torch'))))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert p.stdout.strip() == "[]"


def test_the_search_plans_with_a_calibration_that_kept_its_runs() -> None:
    """A profile `megatrain-plan calibrate` wrote keeps its runs (dicts): the search, which prices a plan once per
    model, workload, plan and calibration, plans with it, and with the calibration's memory terms: two profiles
    alike but for the calibration's process bytes give estimates that differ by exactly that."""
    from megatrain.planner.choice import search
    from megatrain.planner.costs import plan_memory

    runs = ({"name": "h256", "hidden_size": 256, "step_s": 0.3},)
    small, large = (_cpu(calibrations=(_cal(runs=runs, process_bytes=b),)) for b in (300_000_000, 400_000_000))
    work = Workload(128, 2, "float32", True)
    result = search.search(SMALL, work, small)
    assert result.best is not None
    plan = result.best.plan
    a, b = (plan_memory.memory(SMALL, work, plan, hw, None) for hw in (small, large))
    assert b.host_bytes - a.host_bytes == 100_000_000
    assert plan_memory.memory(SMALL, work, plan, small, None) is a  # priced once


# ---- the sparse factor: routed experts against the dense fit --------------------------------------

MOE = model_shapes.from_config(dict(model_type="qwen3_moe", vocab_size=1000, hidden_size=256, intermediate_size=512,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128))


def test_sparse_factor_fit_by_hand() -> None:
    dense = _run("a", 256, 1e12, 100, 10.0)                         # o = 0: r(256) = 1e12 / 10 s = 0.1 TFLOP/s
    # 3e12 FLOPs, 2e12 of them the routed experts', in 40 s: dense part 1e12 / 1e11 = 10 s, so the experts' 2e12
    # took 30 s against 20 s at r(256): s = 30 / 20 = 1.5
    moe = _run("moe", 256, 3e12, 100, 40.0, expert_flops=2e12, spread=0.3)
    cal = fit([dense], "fp32", source="hand", sparse_run=moe)
    assert cal.sparse_factor == pytest.approx(1.5)
    # the sparse run enters no other term: the dense fit without it is the same but for s, spread and its row
    plain = fit([dense], "fp32", source="hand")
    assert plain.sparse_factor == 1.0 and cal.tflops_by_width == plain.tflops_by_width
    assert (cal.adam_params_per_s, cal.temporaries_bytes, cal.process_bytes) == (
        plain.adam_params_per_s, plain.temporaries_bytes, plain.process_bytes)
    assert cal.spread == 0.3 and [r["name"] for r in cal.runs] == ["a", "moe"]
    # with a per-block overhead and eff(t): s = ((compute - o x units) x r(h) x eff(t) - dense FLOPs) / experts
    fitted = _cal(t_half_tokens=1024.0)                            # r(256) = 0.1, o = 2 ms
    run = _run("moe", 256, 3e12, 100, 50.0, expert_flops=2e12, tokens_per_micro_batch=1024)
    rate = 0.1e12 * 1024 / (1024 + 1024)
    assert fit_sparse_factor(run, fitted) == pytest.approx(((50.0 - 2e-3 * 100) * rate - 1e12) / 2e12)


def test_a_sparse_run_without_experts_or_faster_than_its_dense_part_is_refused() -> None:
    dense = _run("a", 256, 1e12, 100, 10.0)
    with pytest.raises(CalibrationError, match="no expert FLOPs"):
        fit([dense], "fp32", sparse_run=_run("moe", 256, 3e12, 100, 40.0))
    with pytest.raises(CalibrationError, match="less than its dense terms") as e:
        fit([dense], "fp32", sparse_run=_run("moe", 256, 3e12, 100, 9.0, expert_flops=2e12))
    assert "\n" not in str(e.value)


def test_profile_round_trips_the_sparse_factor_and_old_profiles_read_one(tmp_path) -> None:
    hw = _cpu(calibrations=(_cal(sparse_factor=1.7),))
    path = tmp_path / "hw.json"
    hw.save(str(path))
    assert HardwareProfile.load(str(path)).fitted("fp32").sparse_factor == 1.7
    data = hw.to_dict()
    del data["calibrations"][0]["sparse_factor"]                     # calibrated before the factor existed
    assert HardwareProfile.from_dict(data).fitted("fp32").sparse_factor == 1.0
    data["calibrations"][0]["sparse_factor"] = 0
    with pytest.raises(HardwareError, match="sparse_factor"):
        HardwareProfile.from_dict(data)


def test_the_sparse_factor_leaves_a_dense_estimate_unchanged() -> None:
    work = Workload(seq_len=128, batch=4, compute_dtype="fp32")
    plan = Plan(micro_batch_size=2)
    one = cost_model.estimate(SMALL, work, plan, _cpu(calibrations=(_cal(),)))
    three = cost_model.estimate(SMALL, work, plan, _cpu(calibrations=(_cal(sparse_factor=3.0),)))
    assert three.step_seconds == one.step_seconds and SMALL.expert_flops_fwd() == 0.0


@pytest.mark.parametrize("kept", [False, True])
def test_the_sparse_factor_scales_the_routed_experts_time_by_hand(kept: bool) -> None:
    work = Workload(seq_len=128, batch=4, compute_dtype="fp32")
    L = MOE.num_layers
    plan = Plan(micro_batch_size=2, kept_layers=tuple(range(L)) if kept else ())
    one = cost_model.estimate(MOE, work, plan, _cpu(calibrations=(_cal(),)))
    two = cost_model.estimate(MOE, work, plan, _cpu(calibrations=(_cal(sparse_factor=2.5),)))
    # the routed experts: 2 x top-k x 3 x h x I per token per layer forward; kept: forward + backward (2x) = 3x,
    # recomputed: 4x; at r(256) = 0.1 TFLOP/s, 1.5 x more of them
    per_token = 2 * 2 * 3 * 256 * 128
    assert MOE.expert_flops_fwd() == per_token
    visits = 3 if kept else 4
    assert two.step_seconds - one.step_seconds == pytest.approx(work.tokens * L * per_token * visits * 1.5 / 0.1e12)
