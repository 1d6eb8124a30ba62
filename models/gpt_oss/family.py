"""gpt-oss: config rules, parameter table, on-disk names and presets. Pure stdlib.

Rules (transformers' ``GptOssConfig``): biases on q, k, v and o (``attention_bias``, absent: true), a learned
attention sink per query head; the MLP is sparse on every layer: ``num_local_experts`` (absent: 128) experts of
width ``intermediate_size``, ``num_experts_per_tok`` (absent: 4) per token, a router with a bias, softmax over
the chosen k (``output_router_logits`` true: its load-balancing loss weighted by ``router_aux_loss_coef``,
absent: 0.001, as for the other sparse families); the experts' clamped SwiGLU with the published
``swiglu_alpha`` 1.702 and ``swiglu_limit`` 7.0 (other values refused). ``layer_types`` (absent: sliding and
full attention alternating, sliding first), the sliding layers seeing the last ``sliding_window`` (absent: 128)
positions. No ``rope_parameters`` (nor ``rope_scaling``): transformers' default, YaRN of factor 32 over 4096
positions, ``rope_theta`` (absent) 150000.
``quantization_config`` may only be MXFP4 (``runtime/io/mxfp4.py`` dequantizes its expert tensors on load).
On disk: the parameters' own names (``mlp.router``, the fused ``mlp.experts.gate_up_proj`` and its bias, ...), as
transformers writes them.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config_fields import (FULL_ATTENTION, SLIDING_ATTENTION, attention_biases, fixed_flag, integer,
                             layer_types, layer_windows, number, optional_integer)
from ..errors import HFConfigError
from ..family import Family, Preset
from ..moe import expert_count, read_experts, write_experts
from ..parameters import Param, head_dim, linear

MODEL_TYPE = "gpt_oss"
ALTERNATING = (SLIDING_ATTENTION, FULL_ATTENTION)  # transformers' default: layer i is ALTERNATING[i % 2]
SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}


def read(data: Mapping[str, Any], num_hidden_layers: int) -> dict[str, Any]:
    for name, value in SWIGLU.items():
        if number(name, data.get(name, value)) != value:
            raise HFConfigError(f"{name}={data[name]!r} is not supported; megatrain trains gpt-oss's published "
                                f"clamped SwiGLU ({name} {value})")
    quantization = data.get("quantization_config")
    if quantization is not None and (not isinstance(quantization, Mapping)
                                     or quantization.get("quant_method") != "mxfp4"):
        raise HFConfigError(f"quantization_config={quantization!r} is not supported; megatrain loads gpt-oss's "
                            "MXFP4 experts or plain float weights")
    window = optional_integer("sliding_window", data.get("sliding_window", 128))
    types = data.get("layer_types") or [ALTERNATING[i % 2] for i in range(num_hidden_layers)]
    return {**attention_biases(MODEL_TYPE, {**data, "attention_bias": data.get("attention_bias", True)}, mlp=False),
            "qk_norm": fixed_flag(MODEL_TYPE, data, "qk_norm", False),
            **layer_windows(window, layer_types("layer_types", types, num_hidden_layers)),
            **read_experts(MODEL_TYPE, {**data, "num_experts_per_tok": data.get("num_experts_per_tok", 4)},
                           experts=expert_count(MODEL_TYPE, data, ("num_local_experts",), 128),
                           width=integer("intermediate_size", data["intermediate_size"]), norm_topk_prob=False)}


def write(config: Any) -> dict[str, Any]:
    every = SLIDING_ATTENTION if config.sliding_window else FULL_ATTENTION
    types = list(config.layer_types or [every] * config.num_hidden_layers)
    return {"attention_bias": config.attention_bias, "sliding_window": config.sliding_window, "layer_types": types,
            "num_local_experts": config.num_experts, "intermediate_size": config.moe_intermediate_size, **SWIGLU,
            **write_experts(config)}


def layer(dims: Mapping[str, Any]) -> tuple[Param, ...]:
    """GptOssDecoderLayer's parameters in ``named_parameters`` order: the attention's sinks (its own parameter,
    before its submodules'), its projections (with biases when ``attention_bias``), the router and the experts
    with their biases, the two norms."""
    h, d, bias = dims["hidden_size"], head_dim(dims), bool(dims.get("attention_bias"))
    heads = dims["num_attention_heads"]
    q, kv = heads * d, (dims.get("num_key_value_heads") or heads) * d
    e, i = dims["num_experts"], dims["moe_intermediate_size"]
    return (Param("self_attn.sinks", (heads,)),
            *linear("self_attn.q_proj", h, q, bias), *linear("self_attn.k_proj", h, kv, bias),
            *linear("self_attn.v_proj", h, kv, bias), *linear("self_attn.o_proj", q, h, bias),
            Param("mlp.router.weight", (e, h)), Param("mlp.router.bias", (e,)),
            Param("mlp.experts.gate_up_proj", (e, h, 2 * i)), Param("mlp.experts.gate_up_proj_bias", (e, 2 * i)),
            Param("mlp.experts.down_proj", (e, i, h)), Param("mlp.experts.down_proj_bias", (e, h)),
            Param("input_layernorm.weight", (h,)), Param("post_attention_layernorm.weight", (h,)))


def _gpt_oss(name: str, layers: int, experts: int) -> Preset:
    return Preset(name, {  # openai/gpt-oss-20b, openai/gpt-oss-120b config.json
        "model_type": MODEL_TYPE, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": layers,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 201088,
        "tie_word_embeddings": False, "rope_theta": 150000.0, "max_position_embeddings": 131072,
        "rope_scaling": YARN,
        "sliding_window": 128, "num_local_experts": experts, "num_experts_per_tok": 4, "rms_norm_eps": 1e-5,
        "attention_bias": True, "swiglu_limit": 7.0})


FAMILY = Family(
    model_type=MODEL_TYPE, architecture="GptOssForCausalLM", read=read, write=write,
    defaults={"max_position_embeddings": 131072, "head_dim": 64, "rms_norm_eps": 1e-5, "rope": {
        "rope_theta": 150000.0, "rope_parameters": YARN}},
    presets=(_gpt_oss("gpt-oss-20b", 24, 32), _gpt_oss("gpt-oss-120b", 36, 128)),
    layer=layer, blocks="megatrain.models.gpt_oss.blocks",
)
