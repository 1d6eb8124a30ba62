"""Gemma 3 (text): config rules, presets, and its parameter table (pre- and post-feedforward norms). Pure stdlib.

Rules (transformers' ``Gemma3TextConfig``): ``attention_bias`` on q, k, v and o, none on the MLP; RMSNorm of width
head_dim on q and k; ``hidden_activation`` (absent: gelu_pytorch_tanh; ``hidden_act`` is not read) in the gated
MLP; attention scores scaled by ``query_pre_attn_scalar`` ** -0.5 (absent: 256); ``layer_types`` (absent: every
``sliding_window_pattern``-th layer, default 6, global, the others sliding) with ``sliding_window`` (absent: 4096)
on the sliding layers; the global layers' RoPE is ``rope_theta`` (absent: 1e6) with ``rope_scaling``, the sliding
layers' ``rope_local_base_freq`` (absent: 1e4) unscaled (both spellings: ``hf_config.read_layer_ropes``);
``final_logit_softcapping`` (absent: none) caps the logits, ``attn_logit_softcapping`` must be null and
``use_bidirectional_attention`` false; ``tie_word_embeddings`` absent: true; ``pad_token_id`` absent: 0; ``head_dim``
absent: 256; ``max_position_embeddings`` absent: 131072. On disk: transformers' ``model.``-prefixed names.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config_fields import (FULL_ATTENTION, SLIDING_ATTENTION, activation, attention_biases, boolean, fixed_flag,
                             integer, layer_types, number, optional_integer, optional_positive)
from ..errors import HFConfigError
from ..family import Family, FamilyField, Preset
from ..parameters import Param, llama_layer

MODEL_TYPE = "gemma3_text"
DEFAULT_PATTERN = 6
# Gemma 3's own fields of ModelConfig (None in a config built without them; ``read`` gives transformers' defaults):
# the sliding layers' RoPE base, unscaled (None: the full layers'); attention scores scaled by
# query_pre_attn_scalar ** -0.5 (None: head_dim's); logits capped to c x tanh(logits / c) (None: not capped).
FIELDS = tuple(FamilyField(name, None, optional_positive)
               for name in ("rope_local_base_freq", "query_pre_attn_scalar", "final_logit_softcapping"))


def read(data: Mapping[str, Any], num_hidden_layers: int) -> dict[str, Any]:
    if data.get("attn_logit_softcapping") is not None:
        raise HFConfigError(f"attn_logit_softcapping={data['attn_logit_softcapping']!r} is not supported (Gemma 3 "
                            "has none); set it to null")
    if boolean("use_bidirectional_attention", data.get("use_bidirectional_attention") or False):
        raise HFConfigError("use_bidirectional_attention=true is not supported; megatrain trains causal models: "
                            "set it to false")
    window = optional_integer("sliding_window", data.get("sliding_window", 4096))
    types = data.get("layer_types")
    if types is None:
        pattern = integer("sliding_window_pattern", data.get("sliding_window_pattern", DEFAULT_PATTERN))
        if pattern < 1:
            raise HFConfigError(f"sliding_window_pattern={pattern} must be a positive integer; fix it in the config")
        types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_hidden_layers)]
    types = layer_types("layer_types", types, num_hidden_layers)
    if SLIDING_ATTENTION in types and window is None:
        raise HFConfigError("sliding_window=null with sliding layers in layer_types; give the sliding layers a "
                            "window (transformers' default: 4096)")
    cap = data.get("final_logit_softcapping")
    return {**attention_biases(MODEL_TYPE, data, mlp=False), "qk_norm": fixed_flag(MODEL_TYPE, data, "qk_norm", True),
            "sliding_window": window if SLIDING_ATTENTION in types else None, "layer_types": types,
            "hidden_act": activation("hidden_activation", data.get("hidden_activation", "gelu_pytorch_tanh")),
            "query_pre_attn_scalar": number("query_pre_attn_scalar", data.get("query_pre_attn_scalar", 256)),
            "final_logit_softcapping": None if cap is None else number("final_logit_softcapping", cap)}


def write(config: Any) -> dict[str, Any]:
    full = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    return {"attention_bias": config.attention_bias, "hidden_activation": config.hidden_act,
            "sliding_window": config.sliding_window, "layer_types": list(config.layer_types),
            "query_pre_attn_scalar": _integral(config.query_pre_attn_scalar),
            "final_logit_softcapping": config.final_logit_softcapping, "attn_logit_softcapping": None,
            "rope_parameters": {FULL_ATTENTION: full, SLIDING_ATTENTION: {
                "rope_type": "default", "rope_theta": config.rope_local_base_freq}}}


def _integral(value: float) -> float | int:
    """A number as an integer when it is one (transformers' ``query_pre_attn_scalar`` is an int field)."""
    return int(value) if float(value).is_integer() else value


def layer(dims: Mapping[str, Any]) -> tuple[Param, ...]:
    """Gemma3DecoderLayer's parameters in registration order: the Llama-style layer with q/k norms, then the pre-
    and post-feedforward norms."""
    h = dims["hidden_size"]
    return (*llama_layer(dims), Param("pre_feedforward_layernorm.weight", (h,)),
            Param("post_feedforward_layernorm.weight", (h,)))


FAMILY = Family(
    model_type=MODEL_TYPE, architecture="Gemma3ForCausalLM", read=read, write=write, fields=FIELDS,
    defaults={"max_position_embeddings": 131072, "head_dim": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "rope_local_base_freq": 10000.0, "tie_word_embeddings": True, "pad_token_id": 0},
    layer=layer, blocks="megatrain.models.gemma3_text.blocks", unit_norm_weight=0.0,
    presets=(Preset("Gemma-3-27B", {  # google/gemma-3-27b-pt, its text_config
        "model_type": MODEL_TYPE, "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
        "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "vocab_size": 262208,
        "query_pre_attn_scalar": 168, "sliding_window": 1024, "sliding_window_pattern": 6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "tie_word_embeddings": True}),),
)
