"""Selective recompute in the planner: a kept layer's bytes by hand, the memory and cost models' terms for kept
and recomputed layers, and the search keeping as many layers as memory allows, those whose recompute costs most."""
from __future__ import annotations

import dataclasses

import pytest

from megatrain.planner.costs import cost_model, kept_layers, memory_model
from megatrain.planner.profiling import hardware
from megatrain.planner.choice import search
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan, PlanError
from megatrain.planner.shapes.workload import Workload

# h 48, intermediate 80, 6 heads of 8 (q width 48), 2 kv heads (kv width 16).
MODEL = ModelShape(name="small", hidden_size=48, intermediate_size=80, num_layers=3, num_heads=6, num_kv_heads=2,
                   vocab_size=101, attention_bias=True, mlp_bias=True)
# h 32, intermediate 72, 4 heads of 12 (q width 48), 1 kv head (kv width 12), q/k norms.
QK_NORM = ModelShape(name="qk", hidden_size=32, intermediate_size=72, num_layers=2, num_heads=4, num_kv_heads=1,
                     head_dim=12, vocab_size=64, qk_norm=True, model_type="qwen3")


def test_kept_bytes_per_token_by_hand() -> None:
    # fp32 (c 4): 4 x (5 x 48 + 3 x 48 + 2 x 16 + 4 x 80) = 2944, + 4 x 48 (the residual in fp32) + 8 + 4 x 6 = 3168
    assert kept_layers.kept_bytes_per_token(MODEL, "fp32") == 3168
    # bf16 (c 2): 2 x 736 = 1472, + 192 + 192 (the input norm's fp32 copy) + 8 + 24 = 1888
    assert kept_layers.kept_bytes_per_token(MODEL, "bf16") == 1888
    # q/k norms, fp32: 4 x (160 + 144 + 24 + 288) = 2464, + 128 + 8 + 16 = 2616; q norm (4 + 4) x 48 + 4 x 4,
    # k norm (4 + 4) x 12 + 4 x 1: 2616 + 400 + 100 = 3116
    assert kept_layers.kept_bytes_per_token(QK_NORM, "fp32") == 3116


def test_memory_model_counts_kept_and_recomputed_layers() -> None:
    work = Workload(seq_len=16, batch=4, compute_dtype="bf16")  # T = 64 tokens
    plain = {c.name: c.nbytes for c in memory_model.estimate(MODEL, work, Plan(micro_batch_size=2)).components}
    kept = {c.name: c.nbytes for c in memory_model.estimate(MODEL, work, Plan(micro_batch_size=2, kept_layers=(0, 2))
                                                           ).components}
    assert plain["activation checkpoints"] == 3 * 64 * 48 * 2
    assert kept["activation checkpoints"] == 1 * 64 * 48 * 2  # L - k = 1 layer with a boundary checkpoint
    # k x (T x a + M x S x D x c): 2 layers x (64 tokens x 1888 + 2 micro-batches' RoPE casts of 16 x 8 x 2)
    assert kept["kept activations"] == 2 * (64 * 1888 + 2 * 16 * 8 * 2)
    assert "kept activations" not in plain
    host = {c.name: (c.where, c.nbytes) for c in memory_model.estimate(
        MODEL, work, Plan(checkpoints="host", kept_layers=(0, 1, 2))).components}
    assert host["activation checkpoints"] == ("host", 0)
    assert host["checkpoint drains in flight"] == ("device", 0)  # nothing drains when every layer is kept


def test_cost_model_kept_layers_run_no_recompute() -> None:
    hw = hardware.preset("H100-SXM")
    model = dataclasses.replace(MODEL, hidden_size=2048, intermediate_size=8192, num_heads=16, num_kv_heads=8,
                                num_layers=8, vocab_size=32000, head_dim=128)
    work = Workload(seq_len=2048, batch=8, compute_dtype="bf16")
    none = cost_model.estimate(model, work, Plan(micro_batch_size=8), hw)
    three = cost_model.estimate(model, work, Plan(micro_batch_size=8, kept_layers=(5, 6, 7)), hw)
    every = cost_model.estimate(model, work, Plan(micro_batch_size=8, kept_layers=tuple(range(8))), hw)
    per_layer = work.tokens * model.layer_flops_recompute(2048)
    assert none.recompute_flops == 8 * per_layer and three.recompute_flops == 5 * per_layer
    assert every.recompute_flops == 0
    assert none.hardware_flops - every.hardware_flops == pytest.approx(8 * per_layer)
    # Backward loses exactly the recompute: its FLOPs at the layers' rate and its forward's launches.
    assert every.backward.compute_s < three.backward.compute_s < none.backward.compute_s
    assert none.forward.compute_s == every.forward.compute_s
    assert every.step_seconds < none.step_seconds
    units = cost_model.overhead_units(model, work, Plan(micro_batch_size=8))
    f = cost_model.LAUNCH_FWD_S / (cost_model.LAUNCH_FWD_S + cost_model.LAUNCH_BWD_S)
    assert cost_model.overhead_units(model, work, Plan(micro_batch_size=8, kept_layers=(5, 6, 7))) == \
        pytest.approx(units - 3 * f)


def test_keep_most_finds_the_largest_count_that_fits() -> None:
    work = Workload(seq_len=16, batch=4, compute_dtype="bf16")
    assert kept_layers.keep_order(MODEL, work) == [2, 1, 0]  # alike layers: the later first
    calls = []

    def excess(p: Plan) -> tuple[int]:  # 100 bytes a kept layer, 250 free
        calls.append(p.kept_layers)
        return (100 * len(p.kept_layers) - 250,)
    assert kept_layers.keep_most(MODEL, work, Plan(), excess).kept_layers == (1, 2)
    assert len(calls) <= 4  # all, none, then the guess's two sides
    assert kept_layers.keep_most(MODEL, work, Plan(), lambda p: (1,)).kept_layers == ()
    tiled = Plan(mlp_tile_tokens=4)
    assert kept_layers.keep_most(MODEL, work, tiled, lambda p: (0,)).kept_layers == ()


def test_search_keeps_what_the_gpu_memory_allows() -> None:
    base = hardware.preset("H100-SXM")
    model = dataclasses.replace(MODEL, hidden_size=1024, intermediate_size=4096, num_heads=8, num_kv_heads=8,
                                num_layers=12, vocab_size=32000, head_dim=128)
    work = Workload(seq_len=1024, batch=8, compute_dtype="bf16")
    roomy = search.search(model, work, base.replace(gpu_mem_bytes=80 * hardware.GiB)).require()
    assert roomy.plan.kept_layers == tuple(range(12))
    assert roomy.cost is not None and roomy.cost.recompute_flops == 0
    # A GPU that holds the smallest plan (one sequence per micro-batch, one sequence's logits) with no layer kept
    # plus about five kept layers' activations: no micro-batch keeps every layer there.
    plan = roomy.plan.replace(kept_layers=(), micro_batch_size=1, loss_chunk_tokens=work.seq_len)
    none = memory_model.estimate(model, work, plan, base).device_bytes
    a = kept_layers.kept_activation_bytes(model, work, plan.replace(kept_layers=(0,)))[0]
    tight = base.replace(gpu_mem_bytes=int(none + 5.5 * a * 1.06))
    best = search.search(model, work, tight).require()
    assert 0 < len(best.plan.kept_layers) < 12
    assert memory_model.estimate(model, work, best.plan, tight).overruns(tight) == []
    more = best.plan.replace(kept_layers=kept_layers.keep_order(model, work)[:len(best.plan.kept_layers) + 1])
    assert memory_model.estimate(model, work, more, tight).overruns(tight)  # one more would not fit


def test_plan_refuses_bad_kept_layers() -> None:
    with pytest.raises(PlanError, match="names a layer twice"):
        Plan(kept_layers=(1, 1))
    with pytest.raises(PlanError, match="decoder layer numbers"):
        Plan(kept_layers=(-1,))
    with pytest.raises(PlanError, match="this model has 3 decoder layers"):
        Plan(kept_layers=(3,)).check_kept_layers(3)
    assert Plan.from_json(Plan(kept_layers=(2, 0)).to_json()).kept_layers == (0, 2)
