"""Gemma 3's blocks, as transformers' ``Gemma3TextModel`` computes them.

Embeddings times sqrt(hidden_size), the factor rounded to the embedding's dtype first
(``Gemma3TextScaledWordEmbedding``); every norm is ``Gemma3RMSNorm``: normed in fp32, times (1 + weight) in fp32,
then cast; a layer is h = x + post_attention_norm(attention(input_norm(x))), out = h +
post_feedforward_norm(mlp(pre_feedforward_norm(h))); q and k are normed per head before RoPE; attention scores
are scaled by ``query_pre_attn_scalar`` ** -0.5. Sliding and global layers differ only in their configuration
(window and RoPE: the runtime builds one template per layer type). The final logit soft-cap is the head loss's.
"""
from __future__ import annotations

import torch
from torch import nn

from megatrain.models.model_config import ModelConfig
from megatrain.models.layers.attention import Documents, causal_attention
from megatrain.models.layers.decoder import MLP, Attention
from megatrain.models.layers.decoder import DecoderLayer as SharedDecoderLayer
from megatrain.models.layers.decoder import EmbeddingBlock as SharedEmbeddingBlock
from megatrain.models.layers.decoder import HeadBlock as SharedHeadBlock

__all__ = ["EmbeddingBlock", "DecoderLayer", "HeadBlock"]


class RMSNorm(nn.Module):
    """x normed in fp32, times (1 + weight) in fp32, cast back (``Gemma3RMSNorm``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class EmbeddingBlock(SharedEmbeddingBlock):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.scale = config.hidden_size ** 0.5

    def output_scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden_size) rounded to ``dtype``, as transformers' ``embed_scale.to(weight.dtype)``."""
        return torch.tensor(self.scale).to(dtype).item()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, S] int64 -> [B, S, hidden], scaled."""
        x = self.embed_tokens(input_ids)
        return x * self.output_scale(x.dtype)


class GemmaAttention(Attention):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = config.query_pre_attn_scalar ** -0.5

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        return causal_attention(q, k, v, scale=self.scale, documents=documents, window=self.window)


class DecoderLayer(SharedDecoderLayer):
    """h = x + post_attention_norm(attention(input_norm(x))); out = h + post_feedforward_norm(mlp(pre_norm(h)))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, mlp=MLP, attention=GemmaAttention)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)

    def attention_output(self, out: torch.Tensor) -> torch.Tensor:
        return self.post_attention_layernorm(self.self_attn.output(out))

    def mlp_branch(self, h: torch.Tensor) -> torch.Tensor:
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class HeadBlock(SharedHeadBlock):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
