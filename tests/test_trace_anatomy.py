"""The trace anatomy (tools/trace_anatomy.py): interval arithmetic by hand, both device paths on
synthetic traces, and a real CPU trace of the engine; the kernels' categories (tools/kernel_categories.py) on a
synthetic CUDA trace by hand and on a real CPU trace against the profiler's own per-operator table."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan
from megatrain.tools.kernel_categories import ORDER, category, kernel_breakdown
from megatrain.tools.trace_anatomy import anatomy, profile_kwargs, union_seconds

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def ev(name: str, start: float, end: float, device=CPU, thread: int = 0, self_us: float = 0.0) -> SimpleNamespace:
    """A trace record; thread 0 the compute thread, 1 the AdamW worker; ``self_us`` its own CPU time."""
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                           thread=thread, self_cpu_time_total=self_us)


def test_union_counts_overlaps_once():
    assert union_seconds([]) == 0
    assert union_seconds([(0, 1e6)]) == 1.0
    # [0,2] ∪ [1,3] ∪ [5,6] ∪ [5.5,5.8] = 3 + 1 seconds
    assert union_seconds([(5e6, 6e6), (0, 2e6), (1e6, 3e6), (5.5e6, 5.8e6)]) == pytest.approx(4.0)


def test_cuda_trace_counts_kernels_and_copies_on_the_device():
    events = [
        ev("fwd[1]", 0, 100),  # host ranges: ignored for compute when the device has kernels
        ev("ampere_sgemm", 10, 40, CUDA), ev("elementwise", 40, 50, CUDA),
        ev("Memset (Device)", 50, 60, CUDA),
        ev("Memcpy HtoD (Pinned -> Device)", 0, 30, CUDA), ev("Memcpy HtoD (Pinned -> Device)", 20, 35, CUDA),
        ev("Memcpy DtoH (Device -> Pinned)", 60, 65, CUDA),
        ev("adam[1]", 0, 80, thread=1), ev("shadow[1]", 60, 80, thread=1),
        ev("adam_wait[1]", 80, 200, thread=1),  # the wait is not AdamW work
    ]
    a = anatomy(events, steps=2, step_seconds=100e-6)
    assert a["source"] == "cuda" and a["adam_traced"]
    assert a["compute_s"] == pytest.approx(40e-6 / 2)
    assert a["h2d_s"] == pytest.approx(35e-6 / 2) and a["d2h_s"] == pytest.approx(5e-6 / 2)
    assert a["adam_s"] == pytest.approx(80e-6 / 2) and a["shadow_s"] == pytest.approx(20e-6 / 2)
    assert a["bound_by"] == "adam" and a["roofline_s"] == pytest.approx(40e-6)
    assert a["roofline_ratio"] == pytest.approx(2.5)


def test_cpu_trace_takes_copies_out_of_compute():
    events = [ev("fwd[1]", 0, 100), ev("h2d[2]", 90, 120), ev("bwd[1]", 200, 300), ev("d2h[1]", 300, 310),
              ev("head[3]", 120, 150), ev("aten::mm", 0, 100)]
    a = anatomy(events, steps=1, step_seconds=400e-6)
    assert a["source"] == "cpu" and not a["adam_traced"]
    assert a["compute_s"] == pytest.approx((100 + 30 + 100 - 10) * 1e-6)
    assert a["h2d_s"] == pytest.approx(30e-6) and a["d2h_s"] == pytest.approx(10e-6) and a["adam_s"] == 0
    assert a["bound_by"] == "compute"


def test_adamw_on_the_compute_thread_adds_to_compute_in_the_roofline():
    """AdamW traced on the compute thread (Plan.adam_thread "compute") runs in series with compute: the roofline
    is their sum (70 + 40 us), not the larger of the two; on the worker thread it is the larger (70 us)."""
    for thread, roofline, bound in ((0, 110e-6, "compute+adam"), (1, 70e-6, "compute")):
        events = [ev("fwd[1]", 0, 30), ev("bwd[1]", 30, 70), ev("adam[1]", 70, 110, thread=thread)]
        a = anatomy(events, steps=1, step_seconds=120e-6)
        assert a["compute_s"] == pytest.approx(70e-6) and a["adam_s"] == pytest.approx(40e-6)
        assert a["roofline_s"] == pytest.approx(roofline) and a["bound_by"] == bound


def test_a_real_cpu_trace_has_every_resource():
    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2)
    ids = torch.randint(0, 256, (4, 32))
    with Engine(cfg, OptimizerConfig(), plan=Plan(), compute_dtype=torch.float32, device="cpu") as engine:
        engine.step(ids, ids)
        engine.synchronize()
        with torch.profiler.profile(**profile_kwargs(cuda=False)) as prof:
            for _ in range(2):
                engine.step(ids, ids)
            engine.synchronize()
    a = anatomy(prof.events(), steps=2, step_seconds=0.5)
    assert a["adam_traced"], "the AdamW worker thread was not traced"
    for k in ("compute_s", "h2d_s", "d2h_s", "adam_s"):
        assert a[k] > 0, (k, a)   # each resource's phases were found in the trace
    assert a["source"] == "cpu" and a["bound_by"] in ("compute", "h2d", "d2h", "adam")


def test_step_anatomy_benchmark_reports_each_configuration(tmp_path, capsys):
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "step_anatomy.py")
    spec = importlib.util.spec_from_file_location("step_anatomy", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--model", "tiny", "--variant", "nope", "--device", "cpu"]) == 2
    assert "--variant 'nope' is unknown" in capsys.readouterr().err
    assert bench.main(["--model", "tiny", "--seq", "32", "--batch", "4", "--micro-batch", "2", "--variant",
                       "planner,host-ckpt", "--warmup", "1", "--steps", "1", "--traced", "1", "--device", "cpu",
                       "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("*_cpu_step_anatomy_tiny.json")  # named by the models it ran
    runs = json.loads(result.read_text())["runs"]
    assert [(r["variant"], r["status"]) for r in runs] == [("planner", "ok"), ("host-ckpt", "ok")]
    assert runs[1]["plan"]["checkpoints"] == "host" and runs[1]["events"]["ckpt_traffic_s"] > 0
    for r in runs:
        e = r["events"]
        # 1 step; the planner's CPU plans run AdamW on the compute thread, in series with compute
        assert r["plan"]["adam_thread"] == "compute"
        assert e["roofline_s"] == max(e["compute_s"] + e["adam_busy_s"], e["h2d_busy_s"], e["d2h_busy_s"])
        assert r["trace"]["adam_traced"] and r["trace"]["roofline_ratio"] > 0
        k = r["kernels"]  # the traced step's operators by category: the engine's matmuls in gemm
        assert k["source"] == "cpu" and sum(k["seconds"].values()) == pytest.approx(k["total_s"])
        assert k["seconds"]["gemm"] > 0 and k["seconds"]["optimizer"] > 0
    md = result.with_suffix(".md").read_text()
    assert "| tiny | 32 | host-ckpt |" in md and "Kernel time by category" in md
    # --traced 0 (long sequences): no profiler; model TFLOP/s and MFU by hand from the row's own figures
    assert bench.main(["--model", "tiny", "--seq", "32", "--batch", "4", "--micro-batch", "2", "--no-clip",
                       "--planner-only", "--warmup", "0", "--steps", "1", "--traced", "0", "--device", "cpu",
                       "--out", str(tmp_path / "untraced")]) == 0
    (row,) = json.loads(next((tmp_path / "untraced").glob("*.json")).read_text())["runs"]
    assert row["status"] == "ok" and row["trace"] is None and row["kernels"] is None and not row["clipping"]
    # 6 x N_matmul: the tiny shape's matmuls (q, k, v, o, gate, up, down per layer; lm_head), no input embedding
    cfg = bench.model_config("tiny", None, 32)
    h, i, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    n_matmul = L * (2 * h * h + 2 * h * kv + 3 * h * i) + v * h
    tps = 4 * 32 / row["median_step_seconds"]
    assert row["model_tflops"] == pytest.approx(6 * n_matmul * tps / 1e12)
    assert row["all_params_tflops"] == pytest.approx(6 * row["params"] * tps / 1e12)
    assert row["min_step_seconds"] <= row["median_step_seconds"] <= row["max_step_seconds"]
    assert row["mfu"] > 0 and "not traced" in next((tmp_path / "untraced").glob("*.md")).read_text()
    assert row["predicted"]["pinned_host_bytes"] == 0 and row["pinned_host_bytes"] == 0  # a CPU pins nothing
    untraced = ["--model", "tiny", "--seq", "32", "--batch", "4", "--micro-batch", "2", "--warmup", "0", "--steps",
                "1", "--traced", "0", "--device", "cpu", "--out", str(tmp_path / "untraced")]
    first = (tmp_path / "untraced").glob("*.json").__next__().read_text()
    assert bench.main(untraced) == 0  # the same day, models and folder: a new file beside the first, never over it
    names = sorted(p.name for p in (tmp_path / "untraced").glob("*.json"))
    assert [n.split("_", 1)[1] for n in names] == ["cpu_step_anatomy_tiny.json", "cpu_step_anatomy_tiny_2.json"]
    assert (tmp_path / "untraced" / names[0]).read_text() == first


def test_kernel_categories_of_a_cuda_trace_by_hand():
    """H200-style kernel names, 2 traced steps: each kernel's duration in its category, DMA copies and memsets
    left out (they are trace_anatomy's H2D / D2H), the CPU side ignored where the device has kernels."""
    k = [("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", 100, "gemm"),
         ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", 60, "gemm"),
         ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", 40, "attention"),
         ("fmha_cutlassB_bf16_aligned_64x64_k128_sm80", 20, "attention"),  # CUTLASS, but attention first
         ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)>", 8,
          "elementwise"),
         ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>", 4,
          "elementwise"),
         ("void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda()>", 6, "copy"),
         ("void at::native::cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>", 5,
          "cross_entropy"),
         ("void multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", 3, "optimizer"),
         ("void multi_tensor_apply_kernel<TensorListMetadata<1>, LpNormFunctor<float, 2>>", 1, "optimizer"),
         ("_rms_norm_forward_kernel", 2, "norm"), ("_triton_rope", 2, "rope"), ("_swiglu_backward_kernel", 2, "swiglu"),
         ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", 3, "compiled"),  # a cast inside: not a copy
         ("triton_poi_fused_mul_silu_1", 2, "compiled"),
         ("my_property_kernel", 10, "other")]  # "property" holds "rope": not RoPE
    events = [ev(name, 0, us, CUDA) for name, us, _ in k]
    events += [ev("Memcpy HtoD (Pinned -> Device)", 0, 500, CUDA), ev("Memset (Device)", 0, 50, CUDA),
               ev("aten::mm", 0, 1000, self_us=1000)]
    b = kernel_breakdown(events, steps=2)
    want = dict.fromkeys(ORDER, 0.0)
    for name, us, cat in k:
        assert category(name) == cat, name
        want[cat] += us / 2 / 1e6
    assert b["source"] == "cuda" and b["seconds"] == pytest.approx(want)
    assert b["total_s"] == pytest.approx(sum(us for _, us, _ in k) / 2 / 1e6)  # 268 us over 2 steps
    assert sum(b["seconds"].values()) == pytest.approx(b["total_s"]) and sum(b["share"].values()) == pytest.approx(1)
    assert b["share"]["gemm"] == pytest.approx(160 / 268)
    assert [t["name"] for t in b["top"][:2]] == [k[0][0], k[1][0]] and b["top"][0]["seconds"] == pytest.approx(50e-6)


def test_kernel_categories_of_a_real_cpu_trace():
    """On a CPU each operator's self time: nested operators count once, the categories sum to the operators'
    total, and the matmul's own time lands in gemm, as the profiler's own per-operator table has it."""
    a, w = torch.randn(256, 512), torch.randn(512, 512)
    labels = torch.randint(0, 512, (256,))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            h = torch.nn.functional.silu(a @ w)
            torch.nn.functional.cross_entropy(h, labels)
    events = prof.events()
    b = kernel_breakdown(events, steps=2)
    assert b["source"] == "cpu" and set(b["seconds"]) == set(ORDER)
    assert sum(b["seconds"].values()) == pytest.approx(b["total_s"])
    assert b["total_s"] == pytest.approx(sum(e.self_cpu_time_total for e in events) / 2e6)
    mm = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key == "aten::mm") / 2e6
    assert mm > 0 and b["seconds"]["gemm"] >= mm * (1 - 1e-9)
    assert b["seconds"]["cross_entropy"] > 0 and b["seconds"]["elementwise"] > 0  # log_softmax / nll; silu
    assert any(t["name"] == "aten::mm" and t["category"] == "gemm" for t in b["top"])


def test_step_anatomy_keeps_the_timed_steps_when_the_trace_is_cut_short(tmp_path, monkeypatch):
    """The time limit's interrupt during the trace's parse (an 8B step's takes about a minute): the report on
    disk already holds the configuration's timed steps."""
    import importlib.util
    import json
    import os

    import megatrain.tools.kernel_categories as kc

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "step_anatomy.py")
    spec = importlib.util.spec_from_file_location("step_anatomy", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def interrupted(events, steps):
        raise KeyboardInterrupt

    monkeypatch.setattr(kc, "kernel_breakdown", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--model", "tiny", "--seq", "32", "--batch", "4", "--micro-batch", "2", "--warmup", "0",
                    "--steps", "2", "--traced", "1", "--device", "cpu", "--out", str(tmp_path)])
    (row,) = json.loads(next(tmp_path.glob("*.json")).read_text())["runs"]
    assert row["status"] == "ok" and row["timed_steps"] == 2 and row["trace"] is None
    assert row["min_step_seconds"] <= row["median_step_seconds"] <= row["max_step_seconds"]
