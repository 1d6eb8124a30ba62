"""What a mixture-of-experts layer allocates, per token, per routed pair and per micro-batch: the memory model's
sparse terms, read from the runtime's sparse MLPs (models/layers/moe.py, sorted_experts.py, expert_group.py,
gpt_oss/blocks.py; runtime/pipeline/experts/expert_layers.py, router_balance.py) and checked against what their
autograd graphs and buffers hold (tests/test_plan_runtime_agreement_moe.py).

Symbols: c the compute dtype's bytes; h hidden; E experts; k experts a token is routed to (so T x k routed pairs);
I an expert's width; Ish the shared expert's width (Qwen2-MoE; 0 elsewhere); w the routing weights' bytes when
they scale the experts' outputs (4 where the family keeps them fp32, Mixtral; else c); g the [pairs, I] tensors
a family's gated activation saves beyond its [pairs, 2I] input (2 for SiLU x up: act(gate) and the product; 5
for gpt-oss's clamped SwiGLU: clamped gate, clamped up + 1, the sigmoid, gate x sigmoid and the product).

What one sparse layer's forward saves for its backward (each storage once), beside the attention half:

- the router: softmax over all E experts in fp32 (4E) and the top-k indices (8k); with renormalised top-k weights
  their sum and the top-k values (4 + 4k); gpt-oss: the top-k indices and the softmax of the top-k logits (8k + ck);
  with the load-balancing loss the logits the loss's backward reads (cE; router_balance.py);
- each routed pair: its token's hidden state gathered (h c), the gate/up output (2I c) and the gated
  activation's g tensors (g I c), the down output (h c) and its weighted copy that ``index_add_`` reads (h c), its
  routing weight gathered (w), its token's index and its place in the sorted order, or its choice (16): per pair
  c x (3h + (2 + g) I) + w + 16; gpt-oss on the grouped path also its expert's index for the biases (8);
- per micro-batch on the grouped path, each expert's end among the sorted pairs (4E, int32);
- Qwen2-MoE's shared expert: the dense MLP's four tensors of its width, its output, the sigmoid of its gate:
  c x (4 Ish + h + 1).

The grouped path runs in float32 on a CPU (``sorted_experts.grouped_mm_runs``); the planner counts it for fp32 and
the loop for bf16 / fp16, which differ only by the 4E ends and gpt-oss's 8 bytes a pair (CUDA runs the loop in
fp32 and, on Hopper and Blackwell, the grouped path in bf16: a few bytes a pair off there).

gpt-oss's attention (``attention.sink_attention``) saves q, k, v and its output padded with one sink row per
sequence and ``SINK_COLUMNS`` columns per head, and its fp32-multiplying norms (OLMo 2's) save an fp32 product in
bf16 / fp16 where Llama's save a compute-dtype one: (4 - c) x h more per norm.

Pure stdlib.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatrain.planner.shapes.model_shapes import ModelShape, dtype_bytes

SINK_COLUMNS = 8  # models/layers/attention.py: the columns a sink adds to each head of q, k, v


@dataclass(frozen=True)
class SparseFamily:
    """How a family's sparse layer computes, as far as its memory goes."""

    softmax_all: bool = True  # the router softmaxes all E logits in fp32 (Qwen-MoE, Mixtral); else the top-k's
    weights_fp32: bool = False  # the routing weights scale the experts' outputs in fp32 (Mixtral)
    glu_saved: int = 2  # g: [pairs, I] tensors the gated activation saves beyond its input
    expert_biases: bool = False  # gpt-oss: per-pair biases gathered by expert index on the grouped path
    sinks: bool = False  # gpt-oss: attention sinks and OLMo 2 norms


FAMILIES = {"qwen3_moe": SparseFamily(), "qwen2_moe": SparseFamily(), "mixtral": SparseFamily(weights_fp32=True),
            "gpt_oss": SparseFamily(softmax_all=False, glu_saved=5, expert_biases=True, sinks=True)}


def family(model: ModelShape) -> SparseFamily:
    """The model's sparse traits (a sparse family not listed computes as Qwen-MoE)."""
    return FAMILIES.get(model.model_type, SparseFamily())


def grouped_path(dtype: str) -> bool:
    """Whether the planner counts the grouped path's buffers (float32: the CPU's grouped path; module note)."""
    return dtype_bytes(dtype) == 4


def weight_bytes(model: ModelShape, dtype: str) -> int:
    """w: the routing weights' bytes where they scale the experts' outputs (4 for Mixtral, else c)."""
    return 4 if family(model).weights_fp32 else dtype_bytes(dtype)


def router_bytes_per_token(model: ModelShape, dtype: str) -> int:
    """What the router saves per token: 4E + 8k [+ 4 + 4k renormalised] [+ cE with the load-balancing loss];
    gpt-oss 8k + ck [+ cE]."""
    c, x = dtype_bytes(dtype), model.experts
    E, k = x.num_experts, x.num_experts_per_tok
    if family(model).softmax_all:
        n = 4 * E + 8 * k + ((4 + 4 * k) if x.norm_topk_prob or model.model_type == "mixtral" else 0)
    else:
        n = 8 * k + c * k
    return n + (c * E if x.router_aux_loss_coef is not None else 0)


def pair_bytes(model: ModelShape, dtype: str) -> int:
    """What each routed pair saves: c x (3h + (2 + g) I) + w + 16 [+ 8: gpt-oss's expert index, grouped path]."""
    c, f = dtype_bytes(dtype), family(model)
    h, I = model.hidden_size, model.experts.moe_intermediate_size
    index = 8 if f.expert_biases and grouped_path(dtype) else 0
    return c * (3 * h + (2 + f.glu_saved) * I) + weight_bytes(model, dtype) + 16 + index


def shared_bytes_per_token(model: ModelShape, dtype: str) -> int:
    """Qwen2-MoE's shared expert: c x (4 Ish + h + 1); 0 without one."""
    Ish = model.experts.shared_expert_intermediate_size
    return dtype_bytes(dtype) * (4 * Ish + model.hidden_size + 1) if Ish else 0


def mlp_kept_bytes_per_token(model: ModelShape, dtype: str) -> int:
    """The sparse MLP's saved bytes per token: router + k x pair + shared."""
    k = model.experts.num_experts_per_tok
    return router_bytes_per_token(model, dtype) + k * pair_bytes(model, dtype) + shared_bytes_per_token(model, dtype)


def micro_batch_bytes(model: ModelShape, dtype: str) -> int:
    """What a sparse layer saves once per micro-batch: the experts' ends on the grouped path, 4E."""
    return 4 * model.experts.num_experts if model.experts.num_experts and grouped_path(dtype) else 0


def attention_bytes_per_token(model: ModelShape, dtype: str) -> int:
    """What a gpt-oss attention half saves beyond a Llama one's, per token: q, k, v and the output SINK_COLUMNS
    wider per head (q and k after RoPE are saved only so padded), 8 x c x (2 heads + 2 kv_heads), and the norms'
    fp32 product in bf16 / fp16, 2 x (4 - c) x h. 0 for other families."""
    if not family(model).sinks:
        return 0
    c = dtype_bytes(dtype)
    return c * SINK_COLUMNS * (2 * model.num_heads + 2 * model.num_kv_heads) + 2 * (4 - c) * model.hidden_size


def sequence_bytes(model: ModelShape, dtype: str) -> int:
    """What a gpt-oss layer saves once per sequence: the sink row of q, k, v and the output, and of the logsumexp,
    c x (2 heads + 2 kv_heads) x (D + SINK_COLUMNS) + 4 heads; 0 for other families."""
    if not family(model).sinks:
        return 0
    c, D = dtype_bytes(dtype), model.head_dim + SINK_COLUMNS
    return c * (2 * model.num_heads + 2 * model.num_kv_heads) * D + 4 * model.num_heads


def transient_bytes_per_token(model: ModelShape, dtype: str) -> int:
    """The sparse MLP's backward's widest gradients at once, per token (an estimate, as the dense layer's): the
    pairs' down-output and weighted-output gradients and their gate/up and activation gradients,
    c x k x (2h + 3I), and the tokens' gradient (h x c)."""
    c, x = dtype_bytes(dtype), model.experts
    return c * (x.num_experts_per_tok * (2 * model.hidden_size + 3 * x.moe_intermediate_size) + model.hidden_size)
