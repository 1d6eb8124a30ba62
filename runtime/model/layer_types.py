"""Layer types: what each decoder layer's attention is, and the configuration a layer of one type is built from.

transformers' ``layer_types`` names each layer ``full_attention`` or ``sliding_attention`` (``ModelConfig.layer_types``;
``None``: every layer alike). A layer of a type is the family's decoder layer built from ``layer_config``: a
full-attention layer without a window, a sliding one with ``sliding_window``; a type may have its own RoPE (the
fields ``layer_config`` changes are the ones the rotary tables read), so the templates hold one layer template per
distinct type and the rotary tables one table per distinct RoPE.
"""
from __future__ import annotations

import dataclasses

from megatrain.models.config_fields import SLIDING_ATTENTION

from megatrain.runtime.config import ModelConfig

def layer_type(config: ModelConfig, layer: int) -> str | None:
    """The type of decoder layer ``layer``, None when every layer is alike."""
    return None if config.layer_types is None else config.layer_types[layer]


def distinct_layer_types(config: ModelConfig) -> tuple[str | None, ...]:
    """The model's layer types, each once, in the order of the first layer of each."""
    return (None,) if config.layer_types is None else tuple(dict.fromkeys(config.layer_types))


def layer_config(config: ModelConfig, kind: str | None) -> ModelConfig:
    """The configuration a decoder layer of type ``kind`` is built from (its template and its RoPE): every layer
    alike (None) is the model's; a full-attention layer has no window; a sliding layer has the model's window, and
    with ``rope_local_base_freq`` that RoPE base, unscaled (Gemma 3's local layers)."""
    if kind is None:
        return config
    if kind != SLIDING_ATTENTION:
        return dataclasses.replace(config, sliding_window=None, layer_types=None)
    local = config.family_field("rope_local_base_freq")  # Gemma 3's; other families have none
    rope = {} if local is None else {"rope_theta": local, "rope_scaling": None}
    return dataclasses.replace(config, layer_types=None, **rope)
