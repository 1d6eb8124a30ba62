"""Phi-3: config rules, presets, and a parameter table with fused projections (``qkv_proj``, ``gate_up_proj``).

Rules (transformers' ``Phi3Config``): no bias anywhere; no q/k norm; ``sliding_window`` on every layer when set
(absent or null: none); ``resid_pdrop`` and ``embd_pdrop`` 0 (megatrain trains without dropout); RoPE default
only (``longrope`` refused); ``max_position_embeddings`` absent: 4096; ``rms_norm_eps`` absent: 1e-5. On disk
and in the blocks the projections are fused as transformers holds them, so the Hugging Face round trip is exact.
Pure stdlib.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config_fields import attention_biases, fixed_flag, number, optional_integer
from ..errors import HFConfigError
from ..family import Family, Preset
from ..parameters import Param, head_dim, linear

MODEL_TYPE = "phi3"


def read(data: Mapping[str, Any], num_hidden_layers: int) -> dict[str, Any]:
    for name in ("resid_pdrop", "embd_pdrop"):
        if number(name, data.get(name, 0.0)) != 0.0:
            raise HFConfigError(f"{name}={data[name]!r} is not supported; megatrain trains without dropout: "
                                "set it to 0.0")
    return {**attention_biases(MODEL_TYPE, data, qkv=False, o=False, mlp=False),
            "qk_norm": fixed_flag(MODEL_TYPE, data, "qk_norm", False),
            "sliding_window": optional_integer("sliding_window", data.get("sliding_window"))}


def write(config: Any) -> dict[str, Any]:
    return {"sliding_window": config.sliding_window, "resid_pdrop": 0.0, "embd_pdrop": 0.0}


def layer(dims: Mapping[str, Any]) -> tuple[Param, ...]:
    """Phi3DecoderLayer's parameters in registration order: o_proj before the fused qkv_proj."""
    h, i, d = dims["hidden_size"], dims["intermediate_size"], head_dim(dims)
    heads = dims["num_attention_heads"]
    kv = dims.get("num_key_value_heads") or heads
    return (*linear("self_attn.o_proj", heads * d, h, False),
            *linear("self_attn.qkv_proj", h, (heads + 2 * kv) * d, False),
            *linear("mlp.gate_up_proj", h, 2 * i, False), *linear("mlp.down_proj", i, h, False),
            Param("input_layernorm.weight", (h,)), Param("post_attention_layernorm.weight", (h,)))


FAMILY = Family(
    model_type=MODEL_TYPE, architecture="Phi3ForCausalLM", read=read, write=write,
    defaults={"max_position_embeddings": 4096, "rms_norm_eps": 1e-5}, layer=layer,
    blocks="megatrain.models.phi3.blocks",
    presets=(Preset("Phi-3-medium", {  # microsoft/Phi-3-medium-4k-instruct
        "model_type": MODEL_TYPE, "hidden_size": 5120, "intermediate_size": 17920, "num_hidden_layers": 40,
        "num_attention_heads": 40, "num_key_value_heads": 10, "vocab_size": 32064, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "sliding_window": 2047, "tie_word_embeddings": False}),),
)
