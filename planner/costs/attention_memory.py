"""The attention call's memory: how the runtime splits heads into SDPA calls under torch's element limit, and what
one call's backward adds to a layer's working set (``memory_model``'s "attention working set" term). Pure stdlib.
"""
from __future__ import annotations

from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload


# The most elements one tensor of one attention call may have (models/layers/attention.py's MAX_ELEMENTS, a flash
# kernel's 32-bit indexing): the heads are split into groups under it.
ATTENTION_MAX_ELEMENTS = 2**31 - 1


def attention_head_groups(rows: int, seq: int, head_dim: int, n_heads: int, n_kv_heads: int,
                          max_elements: int = ATTENTION_MAX_ELEMENTS) -> tuple[int, int, int]:
    """(query heads, kv heads, calls) of the runtime's attention split ([Note: head groups] in attention.py):
    with n_rep = n_heads / n_kv_heads and one head of rows x seq x head_dim elements, the most kv heads g (a
    divisor of n_kv_heads) with g x n_rep x head <= max_elements, each with its n_rep query heads; else one kv
    head with the most query heads r (a divisor of n_rep) with r x head <= max_elements. (One head over the
    limit is refused by the runtime; counted here as one head per call.)"""
    n_rep = n_heads // n_kv_heads
    head = rows * seq * head_dim
    fits = [g for g in range(1, n_kv_heads + 1) if n_kv_heads % g == 0 and g * n_rep * head <= max_elements]
    if fits:
        g = max(fits)
        return g * n_rep, g, n_kv_heads // g
    r = max([r for r in range(1, n_rep + 1) if n_rep % r == 0 and r * head <= max_elements] or [1])
    return r, 1, n_kv_heads * (n_rep // r)


def attention_working_set(model: ModelShape, work: Workload, plan: Plan,
                          grads_counted: bool = False) -> tuple[int, str]:
    """What one attention call's backward adds to the layer working set, for one micro-batch, counted for one
    head group (the calls run one after another; ``attention_head_groups``), and its formula.

    The layer working set already holds q, k, v and the attention output (O(t), flash: no S x S scores).
    Per group of gq query heads and gk kv heads, the backward adds: dq, dk, dv of the group (t x D x (gq + 2 gk)
    x c) and in bf16 / fp16 flash's fp32 dQ accumulator (t x D x gq x a, a = 4 where c < 4, else 0), unless
    ``grads_counted`` (a layer working set that already holds them for every head); and always, when the
    group shares kv heads (gq > gk), dk and dv expanded to its query heads before they are summed
    (t x D x 2 gq x c), and with more than one call the output twice (the groups' outputs, saved for their
    backward, and their concatenation: t x q x c):
      t x D x ([gq x (c + a) + 2 gk x c] [+ 2 gq x c if gq > gk]) [+ t x q x c if calls > 1]
    On a CPU (fp32, torch's flash kernel for CPU) peak memory grows linearly in t: no S x S scores
    (one attention forward + backward, 4 heads / 2 kv heads / D 64: 119, 199, 360 MiB at 16k, 32k, 64k tokens;
    with two calls 426 MiB at 64k: one more output)."""
    c = work.compute_bytes
    a = 4 if c < 4 else 0
    rows = min(plan.micro_batch_size, work.batch)
    t, D, q = rows * work.seq_len, model.head_dim, model.num_heads * model.head_dim
    gq, gk, calls = attention_head_groups(rows, work.seq_len, D, model.num_heads, model.num_kv_heads)
    grads = 0 if grads_counted else gq * (c + a) + 2 * gk * c
    shared = 2 * gq * c if gq > gk else 0
    both = t * q * c if calls > 1 else 0
    terms = ([] if grads_counted else [("gq x (c + a) + 2 gk x c", f"{gq} x {c + a} + 2 x {gk} x {c}")]) + (
        [("2 gq x c", f"2 x {gq} x {c}")] if shared else [])
    formula = (f"t x D x ({' + '.join(n for n, _ in terms) or '0'}){' + t x q x c' if both else ''} = {t} x {D} x "
               f"({' + '.join(v for _, v in terms) or '0'}){f' + {t} x {q} x {c}' if both else ''} "
               f"({calls} call{'s' if calls > 1 else ''} of {gq} query heads)")
    return t * D * (grads + shared) + both, formula
