"""gpt-oss's blocks, computed as transformers 5's ``GptOssForCausalLM`` (architecture only).

Attention: Llama's with biases on q, k, v and o, and a learned sink logit per query head joining each query's
softmax (``self_attn.sinks`` [Hq]; ``attention.sink_attention``). The MLP: a router with a bias
(``mlp.router``: logits = x W^T + b, the top-k logits of each token, softmax over those k in the compute dtype;
the logits, bias included, are what the load-balancing loss takes, as transformers records them),
and experts with biases kept as transformers keeps them, input-major: ``gate_up_proj`` [E, hidden, 2I] (gate
and up interleaved: columns 0, 2, 4, ... gate, 1, 3, 5, ... up), ``gate_up_proj_bias`` [E, 2I], ``down_proj``
[E, I, hidden], ``down_proj_bias`` [E, hidden]. An expert computes the clamped SwiGLU: gate clamped above at
``SWIGLU_LIMIT``, up to +-``SWIGLU_LIMIT``, (up + 1) x gate x sigmoid(``SWIGLU_ALPHA`` x gate), then down with
its bias; its output scaled by the token's weight is added into the token's row (``index_add_``), as
``GptOssExperts`` does, run over the routing sorted by expert as grouped matrix multiplies (each pair's biases
gathered by its expert) or expert by expert ([Note: grouped experts] in ``layers/sorted_experts.py``). Norms
multiply in fp32 and then cast (``GptOssRMSNorm``).

An expert no token is routed to gets no row: its gradient, biases included, is zero and AdamW still decays it.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.models.model_config import ModelConfig
from megatrain.models.layers import decoder
from megatrain.models.layers import routing_observer
from megatrain.models.layers.attention import Documents, sink_attention
from megatrain.models.layers.sorted_experts import ExpertTensors, FusedExperts
from megatrain.models.olmo2.blocks import RMSNorm

__all__ = ["EmbeddingBlock", "DecoderLayer", "HeadBlock", "SWIGLU_ALPHA", "SWIGLU_LIMIT"]

EmbeddingBlock = decoder.EmbeddingBlock
SWIGLU_ALPHA = 1.702  # the sigmoid's gain (transformers' swiglu_alpha)
SWIGLU_LIMIT = 7.0  # the clamp on gate (above) and up (both sides) (transformers' swiglu_limit)


class SinkAttention(decoder.Attention):
    """Llama's attention (biases from the config) with ``sinks`` [Hq] registered after o_proj."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        return sink_attention(q, k, v, self.sinks, scale=self.head_dim ** -0.5, documents=documents,
                              window=self.window)


class Router(nn.Module):
    """``mlp.router``: weight [E, hidden], bias [E]; tokens [T, hidden] -> top-k weights [T, k], experts [T, k]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.empty(config.num_experts))
        self.top_k: int = config.num_experts_per_tok

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)  # [T, E], the bias included, as GptOssTopKRouter returns them
        observer = routing_observer.current()  # the runtime's statistics and load-balancing loss, if any
        if observer is not None:
            logits = observer.logits(logits)
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        if observer is not None:
            observer.routed(experts)
        return torch.softmax(top, dim=1, dtype=top.dtype), experts


class Experts(FusedExperts):
    """``mlp.experts``: the fused expert tensors and their biases (module docstring)."""

    FUSED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))

    def tensors(self, fused: Mapping[str, torch.Tensor]) -> ExpertTensors:
        """The input-major tensors as they are, the clamped SwiGLU, the biases."""
        return ExpertTensors(fused["gate_up_proj"], fused["down_proj"], clamped_swiglu, fused["gate_up_proj_bias"],
                             fused["down_proj_bias"])


def clamped_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, up interleaved) -> [T, I], as ``GptOssExperts._apply_gate``."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=SWIGLU_LIMIT)
    up = up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))


class SparseMLP(nn.Module):
    """Router, then experts. x [B, S, hidden] -> [B, S, hidden]."""

    ROUTER = "router"  # the router's attribute (expert_group.dense routes with it); its weights in x's dtype

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.router = Router(config)
        self.experts = Experts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        weights, experts = self.router(tokens)
        return self.experts(tokens, weights, experts).reshape(b, s, h)


class DecoderLayer(decoder.DecoderLayer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, mlp=SparseMLP, attention=SinkAttention)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class HeadBlock(decoder.HeadBlock):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
