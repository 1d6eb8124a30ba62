"""Qwen2: config rules and presets (Qwen2.5); its blocks and parameter table are the shared Llama-style ones.

Rules (transformers' ``Qwen2Config``): q, k and v always have a bias, o and the MLP none; no q/k norm; a sliding
window only when ``use_sliding_window`` is true, on the layers ``layer_types`` names ``sliding_attention``
(absent: layers >= ``max_window_layers``, default 28), the others attending to the whole sequence;
``max_position_embeddings`` absent: 32768. Pure stdlib.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config_fields import (FULL_ATTENTION, SLIDING_ATTENTION, attention_biases, boolean, fixed_flag, integer,
                             layer_types, layer_windows, optional_integer)
from ..family import Family, Preset

MODEL_TYPE = "qwen2"
DEFAULT_WINDOW = 4096
DEFAULT_MAX_WINDOW_LAYERS = 28


def windows(data: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` by Qwen2's and Qwen3's rule (``config_fields.layer_windows``)."""
    window = optional_integer("sliding_window", data.get("sliding_window", DEFAULT_WINDOW))
    if not boolean("use_sliding_window", data.get("use_sliding_window", False)):
        window = None
    types = data.get("layer_types")
    if types is None:
        first = integer("max_window_layers", data.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS))
        types = [SLIDING_ATTENTION if window is not None and i >= first else FULL_ATTENTION for i in range(layers)]
    return layer_windows(window, layer_types("layer_types", types, layers))


def window_fields(config: Any) -> dict[str, Any]:
    """The config.json fields of the model's windows: ``layer_types`` when only some layers slide."""
    types = {} if config.layer_types is None else {"layer_types": list(config.layer_types)}
    return {"use_sliding_window": config.sliding_window is not None, "sliding_window": config.sliding_window,
            "max_window_layers": 0, **types}


def read(data: Mapping[str, Any], num_hidden_layers: int) -> dict[str, Any]:
    return {**attention_biases(MODEL_TYPE, data, qkv=True, o=False, mlp=False),
            "qk_norm": fixed_flag(MODEL_TYPE, data, "qk_norm", False),
            **windows(data, num_hidden_layers)}


def _qwen25(name: str, h: int, i: int, layers: int, heads: int, kv: int, vocab: int, tie: bool,
            max_pos: int = 32768) -> Preset:
    return Preset(name, {
        "model_type": MODEL_TYPE, "hidden_size": h, "intermediate_size": i, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab, "tie_word_embeddings": tie,
        "rope_theta": 1000000.0, "max_position_embeddings": max_pos})


FAMILY = Family(
    model_type=MODEL_TYPE, architecture="Qwen2ForCausalLM", read=read, write=window_fields,
    defaults={"max_position_embeddings": 32768},
    presets=(
        _qwen25("Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 151936, True),
        _qwen25("Qwen2.5-7B", 3584, 18944, 28, 28, 4, 152064, False, 131072),
        _qwen25("Qwen2.5-14B", 5120, 13824, 48, 40, 8, 152064, False, 131072),
        _qwen25("Qwen2.5-32B", 5120, 27648, 64, 40, 8, 152064, False, 131072),
        _qwen25("Qwen2.5-72B", 8192, 29568, 80, 64, 8, 152064, False, 131072),
    ),
)
