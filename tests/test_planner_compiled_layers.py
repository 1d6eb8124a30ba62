"""The planner and ``Plan.compiled_layers``: a profile's measured speedup of a compiled decoder layer
(``compiled_layer_speedup``) read and written, old profiles without it loading; the cost model scaling the layers'
work by it, checked by hand; the search offering compiled layers only where the profile measured them faster (and
for dense whole layers); the probe's answer read by ``megatrain-plan profile``."""
from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest

from megatrain.plan.plan import Plan
from megatrain.planner.choice import plan_variants, search
from megatrain.planner.commands import report
from megatrain.planner.costs import cost_model
from megatrain.planner.profiling import compiled_speedup, hardware
from megatrain.planner.profiling.hardware import HardwareError, HardwareProfile
from megatrain.planner.shapes.model_shapes import PRESETS
from megatrain.planner.shapes.workload import StepBatch, Workload

M1 = PRESETS["shape:Llama-3.2-1B"]


def _h100(speedup: dict[str, float] | None = None) -> HardwareProfile:
    return hardware.preset("H100-SXM").replace(compiled_layer_speedup=speedup or {})


def test_profiles_with_and_without_the_speedup_load() -> None:
    """An old profile (no field) loads as not measured; a measured one round-trips through JSON by dtype name;
    a ratio that is not a positive number is refused in one line."""
    old = _h100().to_dict()
    del old["compiled_layer_speedup"]
    assert HardwareProfile.from_json(json.dumps(old)).compiled_speedup("bf16") is None
    hw = HardwareProfile.from_json(_h100({"bfloat16": 1.25}).to_json())
    assert hw.compiled_speedup("bf16") == hw.compiled_speedup("bfloat16") == 1.25
    assert hw.compiled_speedup("fp32") is None
    for bad in ({"bfloat16": 0.0}, {"bfloat16": "fast"}, {"bfloat16": True}, [1.25]):
        with pytest.raises(HardwareError, match="compiled_layer_speedup"):
            HardwareProfile.from_dict({**old, "compiled_layer_speedup": bad})
    assert "decoder layer compiled: bfloat16 1.25x eager" in report.profile_text(hw, "hw.json")


def test_the_cost_model_divides_the_layers_work_by_the_measured_speedup() -> None:
    """A preset (no attention rate, not calibrated) times a layer visit at T x FLOPs / rate + M x launch, rate =
    peak x t / (t + 128) / NONMATMUL_FACTOR; compiled, the FLOP term is divided by c = 1.25: forward by
    L x T x flops_fwd / rate x (1 - 1 / c), backward by L x T x (recompute + backward FLOPs) / rate x (1 - 1 / c);
    the head, the embedding and the launches as before. Without a measured figure, compiled costs as eager."""
    work = Workload(2048, 8, "bf16", clipping=True)
    plan = Plan(micro_batch_size=4)
    c = 1.25
    eager = cost_model.estimate(M1, work, plan, _h100({"bfloat16": c}))
    compiled = cost_model.estimate(M1, work, plan.replace(compiled_layers=True), _h100({"bfloat16": c}))
    batch = StepBatch.of(work, plan)
    t = batch.micro_tokens
    rate = 790.0 * 1e12 * t / (t + cost_model.T_HALF_TOKENS) / cost_model.NONMATMUL_FACTOR["gpu"]
    assert _h100().tflops("bf16") == 790.0
    T, L = batch.tokens, M1.num_layers
    fwd_saved = L * T * M1.layer_flops_fwd(2048) / rate * (1 - 1 / c)
    bwd_saved = L * T * (M1.layer_flops_recompute(2048) + M1.layer_flops_bwd(2048)) / rate * (1 - 1 / c)
    assert eager.forward.compute_s - compiled.forward.compute_s == pytest.approx(fwd_saved, rel=1e-9)
    assert eager.backward.compute_s - compiled.backward.compute_s == pytest.approx(bwd_saved, rel=1e-9)
    unmeasured = cost_model.estimate(M1, work, plan.replace(compiled_layers=True), _h100())
    assert unmeasured.step_seconds == cost_model.estimate(M1, work, plan, _h100()).step_seconds


def test_the_search_compiles_only_where_the_profile_measured_it_faster() -> None:
    """A compute-bound step (1B, 64 x 2048 on an H100 preset): compiled layers where the profile measured them
    1.5x faster in bf16; eager where it measured them slower, measured nothing (older profiles, a CPU), or
    measured bf16 only and the step computes in fp32."""
    work = Workload(2048, 64, "bf16", clipping=True)

    def best(hw: HardwareProfile, w: Workload = work) -> Plan:
        return search.search(M1, w, hw).require().plan

    chosen = best(_h100({"bfloat16": 1.5}))
    assert chosen.compiled_layers and chosen.workload is not None
    assert not best(_h100({"bfloat16": 0.8})).compiled_layers
    assert not best(_h100()).compiled_layers
    assert not best(_h100({"bfloat16": 1.5}), dataclasses.replace(work, compute_dtype="fp32")).compiled_layers


def test_compiled_variants_are_dense_whole_layers_only() -> None:
    """The variant exists for a dense model's untiled plan; none for a sparse model, sequence tiles or expert
    groups (the runtime refuses those), nor twice."""
    hw, work = _h100({"bfloat16": 1.5}), Workload(2048, 8, "bf16")
    plan = Plan()
    assert plan_variants.compiled(M1, work, plan, hw) == [plan.replace(compiled_layers=True)]
    assert plan_variants.compiled(M1, work, plan.replace(compiled_layers=True), hw) == []
    assert plan_variants.compiled(PRESETS["shape:Qwen3-30B-A3B"], work, plan, hw) == []
    for tiles in (dict(mlp_tile_tokens=1024), dict(attention_tile_tokens=1024), dict(expert_group_size=4)):
        assert plan_variants.compiled(M1, work, plan.replace(**tiles), hw) == []


@pytest.mark.parametrize("answer,expected", [
    ({"speedup": 1.3, "same_attention": True, "compile_s": 40.0}, ({"bfloat16": 1.3}, None)),
    ({"speedup": 1.3, "same_attention": False}, ({}, "other attention operators")),
    (None, ({}, "the probe failed: RuntimeError: no kernel")),
])
def test_the_profile_reads_the_probes_answer(answer, expected, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's JSON line is kept as the dtype's speedup only where the compiled layer ran the eager one's
    attention operators; a probe that fails is named by its last line."""
    def run(cmd, **kwargs):
        assert cmd[1:3] == ["-m", "megatrain.tools.compiled_layer_probe"]
        if answer is None:
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback\nRuntimeError: no kernel\n")
        return subprocess.CompletedProcess(cmd, 0, "compiling\n" + json.dumps(answer) + "\n", "")

    monkeypatch.setattr(compiled_speedup.subprocess, "run", run)
    got, why = compiled_speedup.measure("cuda", "bfloat16", lambda line: None)
    assert got == expected[0]
    assert (why is None) if expected[1] is None else expected[1] in why
