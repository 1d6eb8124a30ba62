"""Qwen3-MoE's blocks: the shared Llama-style blocks (with q/k norm) and the sparse MLP, experts registered
before the router, routing weights cast to the compute dtype."""
from __future__ import annotations

import functools

from megatrain.models.model_config import ModelConfig
from megatrain.models.layers import decoder
from megatrain.models.layers.moe import SparseMLP

EmbeddingBlock = decoder.EmbeddingBlock
HeadBlock = decoder.HeadBlock


class DecoderLayer(decoder.DecoderLayer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, mlp=functools.partial(SparseMLP, router_first=False))
