"""Selective recompute: which decoder layers keep their activations for backward, and what that costs.

A kept layer ([Note: kept layers] in runtime/pipeline/kept_layers.py) holds what autograd saved in its
forward until its backward, instead of one boundary checkpoint, and its backward runs no recompute: one
layer forward less per step. The planner keeps as many layers as the memory left after everything else
allows (``keep_most``: memory grows with every kept layer, by the same bytes each, so the most that fit is where a
line crosses the budget: ``budget_boundary.last_fitting``),
in ``keep_order``: the layers whose recompute costs most per byte kept first.

Pure stdlib.
"""
from __future__ import annotations

from typing import Callable, Sequence

from megatrain.planner.costs import budget_boundary, moe_memory
from megatrain.planner.shapes.model_shapes import ModelShape, dtype_bytes
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload

# Without a plan (``Engine(config)``), the share of the memory free at the first step that kept activations,
# with the step's other activation buffers, may take: the rest stays for what the memory model does not see.
DEFAULT_KEEP_SHARE = 0.5


def kept_bytes_per_token(model: ModelShape, dtype: str) -> int:
    """Bytes per token one kept layer holds from its forward to its backward: what autograd saves for a
    Llama-style layer (models/layers/decoder.py), c the compute dtype's bytes, each storage once:

      the layer's input (h x c) and, in bf16 / fp16, the input norm's fp32 copy of it (h x 4); each RMSNorm's
      rsqrt (4) and normalised input (h x c) and output (h x c, what its projections read): 2 x (4 + 2 h x c);
      q, k, v after RoPE (q_width + 2 kv_width, x c), attention's output and logsumexp (q_width x c +
      heads x 4), o_proj's input (q_width x c); the residual h in fp32 (h x 4: in fp32 itself, else the
      post-attention norm's copy); the MLP's gate, up, act(gate) and their product (4 x intermediate x c);
      with q/k norms, each one's fp32 input, rsqrt per head and output ((4 + c) x width + 4 x heads, q and k):

      c x (5 h + 3 q_width + 2 kv_width + 4 i) + 4 h [+ 4 h if c < 4] + 8 + 4 heads
      [+ (4 + c) x (q_width + kv_width) + 4 x (heads + kv_heads) with q/k norms]

    A sparse layer's MLP term is its family's instead of 4 x i x c (``moe_memory.mlp_kept_bytes_per_token``:
    router, routed pairs, shared expert), and gpt-oss's attention adds its sinks' columns
    (``moe_memory.attention_bytes_per_token``); what it saves per sequence and per micro-batch beside is
    ``kept_activation_bytes``'. The RoPE tables are the step's own (fp32); in bf16 / fp16 each kept micro-batch
    also holds its cast copy (``kept_activation_bytes``). Other layer structures (fused projections, post-norms)
    are estimated by the same terms."""
    c = dtype_bytes(dtype)
    h, i = model.hidden_size, model.experts.mlp_width(model.intermediate_size)
    qw, kvw = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    total = c * (5 * h + 3 * qw + 2 * kvw) + 4 * h + (4 * h if c < 4 else 0) + 8 + 4 * model.num_heads
    if model.experts.num_experts:
        total += moe_memory.mlp_kept_bytes_per_token(model, dtype) + moe_memory.attention_bytes_per_token(model, dtype)
    else:
        total += c * 4 * i
    if model.qk_norm:
        total += (4 + c) * (qw + kvw) + 4 * (model.num_heads + model.num_kv_heads)
    return total


def kept_activation_bytes(model: ModelShape, work: Workload, plan: Plan) -> tuple[int, str]:
    """The kept layers' activations at the end of forward, and the formula: with k kept layers, M micro-batches,
    B sequences and a = ``kept_bytes_per_token``: k x (T x a [+ B x r: gpt-oss's sink rows] [+ M x e: a sparse
    layer's per micro-batch, ``moe_memory.micro_batch_bytes``] [+ M x S x D x c in bf16 / fp16: each
    micro-batch's cos and sin cast to the compute dtype])."""
    k = len(plan.kept_layers)
    c = work.compute_bytes
    T, S, D = work.tokens, work.seq_len, model.head_dim
    a = kept_bytes_per_token(model, work.compute_dtype)
    M = work.micro_batches(min(plan.micro_batch_size, work.batch))
    r, e = moe_memory.sequence_bytes(model, work.compute_dtype), moe_memory.micro_batch_bytes(model, work.compute_dtype)
    rope = S * D * c if c < 4 else 0
    per_layer = T * a + work.batch * r + M * (e + rope)
    terms = [f"{T} x {a}"] + ([f"{work.batch} x {r}"] if r else []) + ([f"{M} x {e}"] if e else []) + \
        ([f"{M} x {S} x {D} x {c}"] if rope else [])
    return k * per_layer, f"k x (T x a{' + B x r' if r else ''}{' + M x e' if e else ''}" \
        f"{' + M x S x D x c' if rope else ''}) = {k} x ({' + '.join(terms)})"


def recomputed_layers(model: ModelShape, plan: Plan) -> int:
    """Decoder layers recomputed from a boundary checkpoint in backward: L - k."""
    return model.num_layers - len([b for b in plan.kept_layers if b < model.num_layers])


def keep_order(model: ModelShape, work: Workload) -> list[int]:
    """The decoder layers in the order the planner keeps them: most recompute FLOPs per byte kept first
    (``layer_flops_recompute`` / ``kept_bytes_per_token``; the layers of one model are alike today, so the
    order falls to the tie-break), ties to the later layer, whose graph backward frees first."""
    seq, a = work.seq_len, kept_bytes_per_token(model, work.compute_dtype)
    cost = {layer: model.layer_flops_recompute(seq) / a for layer in range(model.num_layers)}
    return sorted(cost, key=lambda layer: (-cost[layer], -layer))


def keep_most(model: ModelShape, work: Workload, plan: Plan, excess: Callable[[Plan], Sequence[int]]) -> Plan:
    """``plan`` keeping the first k layers of ``keep_order`` for the largest k that fits (``excess``: a plan's bytes
    needed beyond each budget, at most 0 where it fits; k = 0: none kept, whether or not it fits). Memory grows
    with k, by the same bytes per layer: ``budget_boundary.last_fitting`` finds it in about 4 calls of ``excess``
    (bisection: log2(L) + 2). Sequence tiles keep nothing: they are chosen for sequences whose whole activations
    would not fit; nor do expert groups: they are chosen for layers too large for the device, and a layer in parts
    is recomputed."""
    if plan.mlp_tile_tokens is not None or plan.attention_tile_tokens is not None or plan.expert_group_size:
        return plan.replace(kept_layers=())
    order = keep_order(model, work)

    def with_count(k: int) -> Plan:
        return plan.replace(kept_layers=tuple(order[:k]))

    k = budget_boundary.last_fitting(range(len(order) + 1), lambda k: excess(with_count(k)))
    return with_count(k or 0)


def default_kept_layers(model: ModelShape, work: Workload, plan: Plan, free_bytes: int,
                        activation_bytes: Callable[[Plan], int]) -> tuple[int, ...]:
    """The layers ``Engine(config)`` without a plan keeps for its first step's batch: the most whose step
    activations (``activation_bytes``: ``memory_model.activation_bytes`` of the plan) take at most
    ``DEFAULT_KEEP_SHARE`` of the ``free_bytes`` the device has once the engine is built."""
    budget = DEFAULT_KEEP_SHARE * free_bytes
    return keep_most(model, work, plan, lambda p: (activation_bytes(p) - budget,)).kept_layers
