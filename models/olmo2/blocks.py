"""OLMo 2's blocks: no input norms; the attention's and the MLP's outputs are normed before the residual add
(``post_attention_layernorm``, ``post_feedforward_layernorm``), and q and k are RMS-normed over the whole
projection before RoPE (``Olmo2Attention``). Norms multiply in fp32 and then cast, as ``Olmo2RMSNorm``.
"""
from __future__ import annotations

import torch
from torch import nn

from megatrain.models.model_config import ModelConfig
from megatrain.models.layers.decoder import MLP, Attention, EmbeddingBlock
from megatrain.models.layers.decoder import DecoderLayer as SharedDecoderLayer
from megatrain.models.layers.decoder import HeadBlock as SharedHeadBlock
from megatrain.models.layers.rope import apply_rotary

__all__ = ["EmbeddingBlock", "DecoderLayer", "HeadBlock"]


class RMSNorm(nn.Module):
    """weight x normed x in fp32, then cast (``Olmo2RMSNorm``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class WholeProjectionNormAttention(Attention):
    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        h, q, kv, bias = config.hidden_size, config.q_size, config.kv_size, config.attention_bias
        self.head_dim: int = config.head_dim  # type: ignore[assignment]
        self.window = config.sliding_window
        self.q_proj = nn.Linear(h, q, bias=bias)
        self.k_proj = nn.Linear(h, kv, bias=bias)
        self.v_proj = nn.Linear(h, kv, bias=bias)
        self.o_proj = nn.Linear(q, h, bias=bias)
        self.q_norm = RMSNorm(q, config.rms_norm_eps)
        self.k_norm = RMSNorm(kv, config.rms_norm_eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, s, _ = x.shape
        shape = (b, s, -1, self.head_dim)
        q = self.q_norm(self.q_proj(x)).view(shape).transpose(1, 2)
        k = self.k_norm(self.k_proj(x)).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        return q, k, v


class DecoderLayer(SharedDecoderLayer):
    """h = x + post_attention_norm(attention(x)); out = h + post_feedforward_norm(mlp(h))."""

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.self_attn = WholeProjectionNormAttention(config)
        self.mlp = MLP(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def attention_input(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def attention_output(self, out: torch.Tensor) -> torch.Tensor:
        return self.post_attention_layernorm(self.self_attn.output(out))

    def mlp_branch(self, h: torch.Tensor) -> torch.Tensor:
        return self.post_feedforward_layernorm(self.mlp(h))


class HeadBlock(SharedHeadBlock):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
