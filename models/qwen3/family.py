"""Qwen3: config rules and presets; its blocks and parameter table are the shared Llama-style ones with q/k norm.

Rules (transformers' ``Qwen3Config``): RMSNorm of width head_dim on q and k (``qk_norm``); ``attention_bias`` on
q, k, v and o, none on the MLP; Qwen2's sliding-window rule; ``head_dim`` absent: 128;
``max_position_embeddings`` absent: 32768. Pure stdlib.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config_fields import attention_biases, fixed_flag
from ..family import Family, Preset
from ..qwen2.family import window_fields, windows

MODEL_TYPE = "qwen3"


def read(data: Mapping[str, Any], num_hidden_layers: int) -> dict[str, Any]:
    return {**attention_biases(MODEL_TYPE, data, mlp=False), "qk_norm": fixed_flag(MODEL_TYPE, data, "qk_norm", True),
            **windows(data, num_hidden_layers)}


def write(config: Any) -> dict[str, Any]:
    return {"attention_bias": config.attention_bias, **window_fields(config)}


def _qwen3(name: str, h: int, i: int, layers: int, heads: int, kv: int) -> Preset:
    return Preset(name, {
        "model_type": MODEL_TYPE, "hidden_size": h, "intermediate_size": i, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": 151936, "head_dim": 128,
        "tie_word_embeddings": False, "rope_theta": 1000000.0, "max_position_embeddings": 40960})


FAMILY = Family(
    model_type=MODEL_TYPE, architecture="Qwen3ForCausalLM", read=read, write=write,
    defaults={"max_position_embeddings": 32768, "head_dim": 128},
    presets=(_qwen3("Qwen3-8B", 4096, 12288, 36, 32, 8), _qwen3("Qwen3-32B", 5120, 25600, 64, 64, 8)),
)
