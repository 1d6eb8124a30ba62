"""Phi-3's blocks: the shared decoder with transformers' fused projections (``Phi3Attention``, ``Phi3MLP``).

q, k and v are the column slices [q | k | v] of one ``qkv_proj``; gate and up the two halves of one
``gate_up_proj`` (up * act(gate)). Registration order as transformers': ``o_proj`` before ``qkv_proj``.
"""
from __future__ import annotations

import torch
from torch import nn

from megatrain.models.model_config import ModelConfig
from megatrain.models.layers.decoder import ACTIVATIONS, Attention, EmbeddingBlock, HeadBlock
from megatrain.models.layers.decoder import DecoderLayer as SharedDecoderLayer
from megatrain.models.layers.rope import apply_rotary

__all__ = ["EmbeddingBlock", "DecoderLayer", "HeadBlock"]


class FusedAttention(Attention):
    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.head_dim: int = config.head_dim  # type: ignore[assignment]
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.window = config.sliding_window
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.qkv_proj = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, s, _ = x.shape
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        shape = (b, s, -1, self.head_dim)
        q, k = apply_rotary(q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), cos, sin)
        return q, k, v.reshape(shape).transpose(1, 2)


class FusedMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act_fn = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.act_fn(gate))


class DecoderLayer(SharedDecoderLayer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, mlp=FusedMLP, attention=FusedAttention)
