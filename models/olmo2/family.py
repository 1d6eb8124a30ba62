"""OLMo 2: config rules, presets, and its parameter table (q/k norms over the whole projection, post-norms).

Rules (transformers' ``Olmo2Config``): ``attention_bias`` on q, k, v and o, none on the MLP; RMSNorm on the
whole q and k projections (``qk_norm``, widths heads x head_dim and kv heads x head_dim); no sliding window;
``max_position_embeddings`` absent: 2048; ``rms_norm_eps`` absent: 1e-5. Pure stdlib.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config_fields import attention_biases, fixed_flag
from ..family import Family, Preset
from ..parameters import Param, head_dim, linear

MODEL_TYPE = "olmo2"


def read(data: Mapping[str, Any], num_hidden_layers: int) -> dict[str, Any]:
    return {**attention_biases(MODEL_TYPE, data, mlp=False), "qk_norm": fixed_flag(MODEL_TYPE, data, "qk_norm", True),
            "sliding_window": None}


def write(config: Any) -> dict[str, Any]:
    return {"attention_bias": config.attention_bias}


def layer(dims: Mapping[str, Any]) -> tuple[Param, ...]:
    """Olmo2DecoderLayer's parameters in registration order: attention with its norms, MLP, the two post-norms."""
    h, i, d, bias = dims["hidden_size"], dims["intermediate_size"], head_dim(dims), bool(dims.get("attention_bias"))
    q = dims["num_attention_heads"] * d
    kv = (dims.get("num_key_value_heads") or dims["num_attention_heads"]) * d
    return (*linear("self_attn.q_proj", h, q, bias), *linear("self_attn.k_proj", h, kv, bias),
            *linear("self_attn.v_proj", h, kv, bias), *linear("self_attn.o_proj", q, h, bias),
            Param("self_attn.q_norm.weight", (q,)), Param("self_attn.k_norm.weight", (kv,)),
            *linear("mlp.gate_proj", h, i, False), *linear("mlp.up_proj", h, i, False),
            *linear("mlp.down_proj", i, h, False),
            Param("post_attention_layernorm.weight", (h,)), Param("post_feedforward_layernorm.weight", (h,)))


FAMILY = Family(
    model_type=MODEL_TYPE, architecture="Olmo2ForCausalLM", read=read, write=write,
    defaults={"max_position_embeddings": 2048, "rms_norm_eps": 1e-5}, layer=layer,
    blocks="megatrain.models.olmo2.blocks",
    presets=(Preset("OLMo-2-32B", {  # allenai/OLMo-2-0325-32B
        "model_type": MODEL_TYPE, "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
        "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 100352, "rope_theta": 500000.0,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}),),
)
