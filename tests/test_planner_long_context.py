"""The planner at long context: MLP and attention tiles in the layer working set (by hand), the 8B shape at 512k
tokens."""
from __future__ import annotations

import pytest

from megatrain.planner.profiling import hardware
from megatrain.planner.costs import memory_model
from megatrain.planner.shapes import model_shapes
from megatrain.planner.choice import search
from megatrain.plan.plan import Plan, PlanError
from megatrain.planner.choice.search import InfeasibleError
from megatrain.planner.shapes.workload import Workload


def test_tiled_layer_working_set_by_hand() -> None:
    m = model_shapes.resolve("shape:Llama-3.1-8B")
    work = Workload(seq_len=524288, batch=1, compute_dtype="bf16", clipping=True)
    untiled, _ = memory_model.layer_working_set(m, work, Plan())
    tiled, formula = memory_model.layer_working_set(m, work, Plan(mlp_tile_tokens=4096))
    mlp = 7 * 14336 * 2  # gate, up, act, product saved + 3 transient grads, bf16
    assert m.mlp_working_bytes_per_token("bf16") == mlp
    # The MLP's share goes from S tokens to one tile; dh (S x h x 2) joins.
    assert untiled - tiled == (524288 - 4096) * mlp - 524288 * 4096 * 2
    assert "u x m" in formula
    same, _ = memory_model.layer_working_set(m, work.__class__(4096, 1, "bf16", True), Plan(mlp_tile_tokens=4096))
    assert same == memory_model.layer_working_set(m, work.__class__(4096, 1, "bf16", True), Plan())[0]


def test_tiles_chosen_above_4096_tokens() -> None:
    assert search.sequence_tile_tokens(4096) is None and search.sequence_tile_tokens(4097) == 4096
    with pytest.raises(PlanError, match="mlp_tile_tokens"):
        Plan(mlp_tile_tokens=0)


def test_attention_tiles_in_the_layer_working_set_by_hand() -> None:
    m = model_shapes.resolve("shape:Llama-3.1-8B")
    work = Workload(seq_len=524288, batch=1, compute_dtype="bf16", clipping=True)
    both, formula = memory_model.layer_working_set(m, work, Plan(mlp_tile_tokens=4096, attention_tile_tokens=4096))
    # whole: q, k, v, output, its gradient, dq, dk, dv (4 x 4096 + 4 x 1024), h and dh (2 x 4096) in bf16, the
    # logsumexp (32 heads x 4) and flash's fp32 dq accumulator (4096 x 4); per tile: the norm and o_proj outputs
    # (2 x 4096), q and k before RoPE (4096 + 1024) in bf16 and the norm's fp32 copy (4096 x 4)
    A = 2 * (4 * 4096 + 4 * 1024 + 2 * 4096) + 32 * 4 + 4096 * 4
    a = 2 * (2 * 4096 + 4096 + 1024) + 4096 * 4
    assert (m.attention_whole_bytes_per_token("bf16"), m.attention_tile_bytes_per_token("bf16")) == (A, a)
    mlp = 7 * 14336 * 2
    assert both == 524288 * A + 4096 * mlp + 4096 * a + m.numel_layer * 2 and "v x a" in formula
    mlp_only, _ = memory_model.layer_working_set(m, work, Plan(mlp_tile_tokens=4096))
    assert both < 0.6 * mlp_only                       # the attention half's token-local work was most of it
    # attention tiles alone: the MLP's share for every token
    alone, _ = memory_model.layer_working_set(m, work, Plan(attention_tile_tokens=4096))
    assert alone == 524288 * A + 524288 * mlp + 4096 * a + m.numel_layer * 2


def test_8b_at_512k_fits_an_h200_and_an_h100() -> None:
    m = model_shapes.resolve("shape:Llama-3.1-8B")
    work = Workload(seq_len=524288, batch=1, compute_dtype="bf16", clipping=True)
    best = search.search(m, work, hardware.resolve("H200", "server-2t")).require()
    assert best.plan.mlp_tile_tokens == best.plan.attention_tile_tokens == 4096 and best.plan.checkpoints == "host"
    names = {c.name for c in best.memory.components}
    assert {"layer working set", "checkpoint staging", "activation checkpoints", "logits chunk"} <= names
    assert best.cost is not None and best.cost.step_seconds > 0
    h100 = hardware.resolve("H100-SXM", "server-2t")
    assert search.search(m, work, h100).require().plan.attention_tile_tokens == 4096
    longest = search.longest_context(m, h100)
    assert 524288 < longest < 1048576 and longest % 1024 == 0
    assert search.fits(m, Workload(longest, 1, "bf16", True), h100)
    assert not search.fits(m, Workload(longest + 1024, 1, "bf16", True), h100)
    with pytest.raises(InfeasibleError, match="gpu memory"):
        search.search(m, Workload(longest + 1024, 1, "bf16", True), h100).require()
