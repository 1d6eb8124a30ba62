"""Llama: config rules, presets (Llama 3.1 / 3.2), blocks and parameter table of the shared Llama-style decoder.

Rules (transformers' ``LlamaConfig``): ``attention_bias`` puts a bias on q, k, v and o; ``mlp_bias`` on gate, up
and down; no q/k norm; no sliding window (transformers' Llama has none); ``max_position_embeddings`` absent:
2048. Pure stdlib.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config_fields import attention_biases, fixed_flag
from ..family import Family, Preset

MODEL_TYPE = "llama"


def read(data: Mapping[str, Any], num_hidden_layers: int) -> dict[str, Any]:
    return {**attention_biases(MODEL_TYPE, data), "qk_norm": fixed_flag(MODEL_TYPE, data, "qk_norm", False),
            "sliding_window": None}


def write(config: Any) -> dict[str, Any]:
    return {"attention_bias": config.attention_bias, "mlp_bias": config.mlp_bias}


def _llama3(name: str, h: int, i: int, layers: int, heads: int, kv: int, tie: bool, factor: float,
            head_dim: int | None = None) -> Preset:
    return Preset(name, {
        "model_type": MODEL_TYPE, "hidden_size": h, "intermediate_size": i, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": 128256, "head_dim": head_dim,
        "tie_word_embeddings": tie, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}})


FAMILY = Family(
    model_type=MODEL_TYPE, architecture="LlamaForCausalLM", read=read, write=write,
    defaults={"max_position_embeddings": 2048},
    presets=(
        _llama3("Llama-3.2-1B", 2048, 8192, 16, 32, 8, True, 32.0, head_dim=64),
        _llama3("Llama-3.2-3B", 3072, 8192, 28, 24, 8, True, 32.0, head_dim=128),
        _llama3("Llama-3.1-8B", 4096, 14336, 32, 32, 8, False, 8.0),
        _llama3("Llama-3.1-70B", 8192, 28672, 80, 64, 8, False, 8.0),
        _llama3("Llama-3.1-405B", 16384, 53248, 126, 128, 8, False, 8.0),
    ),
)
