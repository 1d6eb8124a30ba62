"""Mistral: config rules and its preset; its blocks and parameter table are the shared Llama-style ones.

Rules (transformers' ``MistralConfig``): no bias anywhere; no q/k norm; ``sliding_window`` on every layer
(absent: 4096, null: none), applied exactly; ``max_position_embeddings`` absent: 131072. Pure stdlib.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config_fields import attention_biases, fixed_flag, optional_integer
from ..family import Family, Preset

MODEL_TYPE = "mistral"
DEFAULT_WINDOW = 4096


def read(data: Mapping[str, Any], num_hidden_layers: int) -> dict[str, Any]:
    return {**attention_biases(MODEL_TYPE, data, qkv=False, o=False, mlp=False),
            "qk_norm": fixed_flag(MODEL_TYPE, data, "qk_norm", False),
            "sliding_window": optional_integer("sliding_window", data.get("sliding_window", DEFAULT_WINDOW))}


def write(config: Any) -> dict[str, Any]:
    return {"sliding_window": config.sliding_window}


FAMILY = Family(
    model_type=MODEL_TYPE, architecture="MistralForCausalLM", read=read, write=write,
    defaults={"max_position_embeddings": 131072},
    presets=(Preset("Mistral-7B", {  # mistralai/Mistral-7B-v0.1, without its window
        "model_type": MODEL_TYPE, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "rope_theta": 10000.0,
        "max_position_embeddings": 32768, "sliding_window": None}),),
)
