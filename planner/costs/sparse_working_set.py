"""A sparse layer's working set and the state a layer in expert groups holds between its loads: the memory model's
terms for mixture-of-experts layers, built from what their graphs save (``moe_memory``, ``kept_layers``).

Symbols as ``memory_model``'s and ``moe_memory``'s: t the micro-batch's tokens, b its sequences, T the step's
tokens, M its micro-batches; a the kept bytes per token of a layer (``kept_layers.kept_bytes_per_token``), p a
routed pair's (``moe_memory.pair_bytes``), r a sequence's (gpt-oss's sink rows), e a micro-batch's (the grouped
path's ends, 4E); g the expert group's size.

A whole sparse layer recomputed saves for its backward what a kept one holds for one micro-batch,
t x a + b x r + e, and its backward adds the widest gradients (``moe_memory.transient_bytes_per_token``). In expert
groups ([Note: expert groups] in runtime/pipeline/experts/expert_parts.py) no part's graph spans another's: the dense
part's recompute saves the layer's all but its pairs, t x (a - k x p) + b x r, and a group's saves its pairs: a
token reaches at most min(g, k) of a group's experts, so at most t x min(g, k) x p + 4g (its experts' ends on the
grouped path).

Pure stdlib.
"""
from __future__ import annotations

from megatrain.planner.costs import kept_layers, moe_memory
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload


def layer_saved_bytes(model: ModelShape, work: Workload, plan: Plan) -> tuple[int, str]:
    """The most a sparse layer's backward graphs save at once for one micro-batch (module note), and the formula:
    whole, t x (a - i) + b x r + e + q; in groups, max(t x (a - k x p - i) + b x r + q, t x min(g, k) x p + 4g
    [grouped path]); i = h x c in bf16 / fp16, where the recompute's input is not saved (its norm saves its fp32
    copy; a kept layer's graph holds it), else 0; q = S x D x c in bf16 / fp16, the micro-batch's RoPE tables cast
    to the compute dtype (``kept_layers.kept_activation_bytes``), else 0."""
    d, c = work.compute_dtype, work.compute_bytes
    mbs = min(plan.micro_batch_size, work.batch)
    t = mbs * work.seq_len
    a, p = kept_layers.kept_bytes_per_token(model, d), moe_memory.pair_bytes(model, d)
    a -= model.hidden_size * c if c < 4 else 0
    q = work.seq_len * model.head_dim * c if c < 4 else 0
    r, e = moe_memory.sequence_bytes(model, d), moe_memory.micro_batch_bytes(model, d)
    k, E = model.experts.num_experts_per_tok, model.experts.num_experts
    g = plan.expert_group_size
    if not g:
        return t * a + mbs * r + e + q, f"t x (a - i) + b x r + e + q = {t} x {a} + {mbs} x {r} + {e} + {q}"
    g = min(g, E)
    dense = t * (a - k * p) + mbs * r + q
    group = t * min(g, k) * p + (4 * g if e else 0)
    return max(dense, group), (f"max(t x (a - k x p - i) + b x r + q, t x min(g, k) x p + 4g) = max({t} x ({a} - "
                               f"{k} x {p}) + {mbs} x {r} + {q}, {t} x {min(g, k)} x {p} + {4 * g if e else 0})")


def layer_working_set(model: ModelShape, work: Workload, plan: Plan, layer_numel: int) -> tuple[int, str]:
    """One sparse layer's peak (its backward) for one micro-batch, untiled: the saved bytes (``layer_saved_bytes``)
    plus the backward's widest gradients, t x x_t (``moe_memory.transient_bytes_per_token``: of the experts' pairs,
    whole or the group's min(g, k) of k; the dense part's dy and its tokens' gradient, 2 x h x c, in groups),
    plus autograd's parameter gradients of the layer (or the part) in the compute dtype, layer x c. With every
    layer kept nothing is recomputed: a kept layer's backward reads the graph its forward kept (the "kept
    activations" term), so the saved bytes are not counted twice."""
    d, c = work.compute_dtype, work.compute_bytes
    t = min(plan.micro_batch_size, work.batch) * work.seq_len
    if kept_layers.recomputed_layers(model, plan):
        saved, formula = layer_saved_bytes(model, work, plan)
    else:
        saved, formula = 0, "0 (every layer kept)"
    x_t = moe_memory.transient_bytes_per_token(model, d)
    if plan.expert_group_size:
        k, g = model.experts.num_experts_per_tok, min(plan.expert_group_size, model.experts.num_experts)
        x_t = max(2 * model.hidden_size * c, x_t * min(g, k) // k)
    grads = layer_numel * c
    return saved + t * x_t + grads, f"{formula} + t x x_t + layer x c = {saved} + {t} x {x_t} + {layer_numel} x {c}"


def bytes_per_token(model: ModelShape, dtype: str) -> tuple[int, int]:
    """A whole sparse layer's per-token terms where sequence tiles apply (``memory_model.layer_working_set``'s w and
    m): w = a + x_t, the layer's saved bytes and its experts' transient gradients; m = the sparse MLP's share,
    ``moe_memory.mlp_kept_bytes_per_token`` + x_t."""
    x_t = moe_memory.transient_bytes_per_token(model, dtype)
    return (kept_layers.kept_bytes_per_token(model, dtype) + x_t,
            moe_memory.mlp_kept_bytes_per_token(model, dtype) + x_t)


def routed_passes(model: ModelShape, work: Workload, plan: Plan) -> tuple[int, int]:
    """What a layer in expert groups holds between loads (runtime/pipeline/experts/expert_layers.py), in its forward and
    in its backward, for every micro-batch. Forward: h, the routed tokens and the experts' sum (3 x h x c a token),
    the shared term (h x c, Qwen2-MoE: s = 1), the routing weights (k x w), the pairs' sorted order and experts
    (16 x k), each expert's end (4E a micro-batch): T x (c x (3 + s) x h + k x (w + 16)) + M x 4E. Backward: the
    routed tokens and their gradient (2 x h x c), the layer's input copied from a host checkpoint (h x c: host = 1;
    a device checkpoint is held anyway), the routing weights and their gradient (2 x k x w), the pairs and ends as
    in the forward, and each parameter's squared gradient norm (4 x n, n the layer's parameters):
    T x (c x (2 + host) x h + k x (2w + 16)) + M x 4E + 4n."""
    c, h, T = work.compute_bytes, model.hidden_size, work.tokens
    k, E = model.experts.num_experts_per_tok, model.experts.num_experts
    w = moe_memory.weight_bytes(model, work.compute_dtype)
    s = 1 if model.experts.shared_expert_intermediate_size else 0
    host = 1 if plan.checkpoints == "host" else 0
    ends = work.micro_batches(min(plan.micro_batch_size, work.batch)) * 4 * E
    forward = T * (c * (3 + s) * h + k * (w + 16)) + ends
    backward = T * (c * (2 + host) * h + k * (2 * w + 16)) + ends + 4 * len(model.layer_params())
    return forward, backward


def routed_state(model: ModelShape, work: Workload, plan: Plan) -> tuple[int, str]:
    """The larger of ``routed_passes``, with the formula."""
    forward, backward = routed_passes(model, work, plan)
    return max(forward, backward), (f"max(T x (c x (3 + s) x h + k x (w + 16)) + M x 4E, T x (c x (2 + host) x h "
                                    f"+ k x (2w + 16)) + M x 4E + 4n) = max({forward}, {backward})")


def routing_statistics(model: ModelShape) -> tuple[int, str]:
    """The step's routing counts on the device (runtime/pipeline/experts/router_balance.py): [L, E] int64 tokens routed
    per layer and expert, and with the load-balancing loss the loss's [E] assignments (int64), probability sums
    and gradient weights (fp32): 8 x L x E [+ 16 x E]."""
    L, E = model.num_layers, model.experts.num_experts
    aux = model.experts.router_aux_loss_coef is not None
    return 8 * L * E + (16 * E if aux else 0), f"8 x L x E{' + 16 x E' if aux else ''} = 8 x {L} x {E}" + \
        (f" + 16 x {E}" if aux else "")
