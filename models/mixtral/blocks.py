"""Mixtral's blocks: the shared Llama-style blocks with the sparse MLP (router first, float32 routing weights)."""
from __future__ import annotations

import functools

from megatrain.models.model_config import ModelConfig
from megatrain.models.layers import decoder
from megatrain.models.layers.moe import SparseMLP

EmbeddingBlock = decoder.EmbeddingBlock
HeadBlock = decoder.HeadBlock


class DecoderLayer(decoder.DecoderLayer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, mlp=functools.partial(SparseMLP, router_first=True, weights_in_compute_dtype=False))
