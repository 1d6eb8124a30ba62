"""The memory model's attention working set: one head group of the runtime's split, checked by hand."""
from __future__ import annotations

import pytest

from megatrain.planner.costs import attention_memory, memory_model
from megatrain.planner.shapes.model_shapes import PRESETS, from_config
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload
from megatrain.models.layers.attention import head_groups


@pytest.mark.parametrize("rows, seq, head_dim, heads, kv, limit", [
    (1, 4096, 128, 32, 8, 2**31 - 1), (1, 2**20, 128, 32, 8, 2**31 - 1), (2, 2**20, 128, 32, 8, 2**31 - 1),
    (1, 64, 8, 12, 4, 64 * 8 * 6), (1, 64, 8, 12, 4, 64 * 8 * 3), (3, 16, 4, 6, 6, 3 * 16 * 4 * 4),
    (1, 64, 8, 8, 1, 64 * 8 * 4), (1, 64, 8, 8, 1, 64 * 8 * 3), (1, 64, 8, 8, 1, 64 * 8)])
def test_groups_are_the_runtime_split(rows: int, seq: int, head_dim: int, heads: int, kv: int, limit: int) -> None:
    """The planner restates the runtime's rule (it never imports the runtime): the same calls, the largest first."""
    calls = head_groups(rows, seq, head_dim, heads, kv, limit)
    gq = max(q.stop - q.start for q, _ in calls)
    gk = max(k.stop - k.start for _, k in calls)
    assert attention_memory.attention_head_groups(rows, seq, head_dim, heads, kv, limit) == (gq, gk, len(calls))


def test_llama_8b_attention_working_set_by_hand() -> None:
    """Llama-3.1-8B (32 query heads, 8 kv heads, head_dim 128), bf16 (c = 2), one sequence per micro-batch."""
    m = PRESETS["shape:Llama-3.1-8B"]
    plan = Plan(checkpoints="host", mlp_tile_tokens=4096)
    # 128k tokens: one head is 2^17 x 128 = 2^24 elements; all 8 kv heads with their 4 query heads each are
    # 2^29 elements per tensor, under 2^31: one call of gq = 32, gk = 8; the GQA expansion of dk, dv counts.
    work = Workload(seq_len=2**17, batch=1, compute_dtype="bf16")
    nbytes, formula = attention_memory.attention_working_set(m, work, plan)
    assert nbytes == 2**17 * 128 * (32 * (2 + 4) + 2 * 8 * 2 + 2 * 32 * 2)      # 5.5 GiB
    assert "1 call of 32 query heads" in formula
    # 1M tokens: one head is 2^27 elements, 4 query heads per kv head 2^29; 2 kv heads (2^30) fit, 4 do not:
    # 4 calls of gq = 8, gk = 2, and the output exists twice (groups' outputs and their concatenation).
    work = Workload(seq_len=2**20, batch=1, compute_dtype="bf16")
    nbytes, formula = attention_memory.attention_working_set(m, work, plan)
    assert nbytes == 2**20 * 128 * (8 * 6 + 2 * 2 * 2 + 2 * 8 * 2) + 2**20 * 4096 * 2
    assert "4 calls of 8 query heads" in formula
    est = {c.name: c.nbytes for c in memory_model.estimate(m, work, plan).components}
    assert est["attention working set"] == nbytes


def test_no_gqa_expansion_without_shared_kv_heads() -> None:
    """Multi-head attention (kv heads = query heads), fp32 (c = 4), 2 sequences per micro-batch of 100 tokens."""
    m = from_config(dict(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=6))
    work = Workload(seq_len=100, batch=3, compute_dtype="fp32")
    nbytes, formula = attention_memory.attention_working_set(m, work, Plan(micro_batch_size=2))
    assert nbytes == 2 * 100 * 8 * (6 * (4 + 0) + 2 * 6 * 4)          # no flash fp32 accumulator in fp32
    assert formula.startswith("t x D x (gq x (c + a) + 2 gk x c) = 200 x 8 x (6 x 4 + 2 x 6 x 4)")
    # A layer working set that holds every head's dq, dk, dv and accumulator already: nothing more for MHA.
    assert attention_memory.attention_working_set(m, work, Plan(micro_batch_size=2), grads_counted=True)[0] == 0


def test_grads_counted_leaves_the_gqa_expansion_and_the_second_output() -> None:
    """Llama-3.1-8B at 1M tokens, bf16, with dq, dk, dv and the accumulator counted elsewhere."""
    work = Workload(seq_len=2**20, batch=1, compute_dtype="bf16")
    nbytes, _ = attention_memory.attention_working_set(PRESETS["shape:Llama-3.1-8B"], work, Plan(), grads_counted=True)
    assert nbytes == 2**20 * 128 * (2 * 8 * 2) + 2**20 * 4096 * 2
