"""Mixtral: config rules, parameter table, on-disk names and presets. Pure stdlib.

Rules (transformers' ``MixtralConfig``): Mistral's attention (no bias, no q/k norm, ``sliding_window`` absent or
null: none); the MLP is sparse on every layer: ``num_local_experts`` (or ``num_experts``; absent: 8) experts of
width ``intermediate_size``, ``num_experts_per_tok`` (absent: 2) per token, the top-k weights always
renormalised; router before experts. On disk (transformers' ``save_pretrained``): ``block_sparse_moe.gate`` and
``block_sparse_moe.experts.N.w1`` (gate), ``w3`` (up), ``w2`` (down). ``max_position_embeddings`` absent: 131072.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config_fields import attention_biases, fixed_flag, integer, optional_integer
from ..family import Family, Preset
from ..moe import expert_count, moe_layer, per_expert_names, read_experts, write_experts

MODEL_TYPE = "mixtral"


def read(data: Mapping[str, Any], num_hidden_layers: int) -> dict[str, Any]:
    experts = expert_count(MODEL_TYPE, data, ("num_local_experts", "num_experts"), 8)
    return {**attention_biases(MODEL_TYPE, data, qkv=False, o=False, mlp=False),
            "qk_norm": fixed_flag(MODEL_TYPE, data, "qk_norm", False),
            "sliding_window": optional_integer("sliding_window", data.get("sliding_window")),
            **read_experts(MODEL_TYPE, data, experts=experts, width=integer("intermediate_size",
                                                                            data["intermediate_size"]),
                           norm_topk_prob=True)}


def write(config: Any) -> dict[str, Any]:
    return {"sliding_window": config.sliding_window, "num_local_experts": config.num_experts,
            "intermediate_size": config.moe_intermediate_size, **write_experts(config)}


def layer(dims: Mapping[str, Any]) -> tuple[Any, ...]:
    return moe_layer(dims, router_first=True)


FAMILY = Family(
    model_type=MODEL_TYPE, architecture="MixtralForCausalLM", read=read, write=write,
    defaults={"max_position_embeddings": 131072},
    presets=(Preset("Mixtral-8x7B", {  # mistralai/Mixtral-8x7B-v0.1
        "model_type": MODEL_TYPE, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "num_local_experts": 8, "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5}),),
    layer=layer, layer_disk_tensors=per_expert_names("block_sparse_moe", ("w1", "w3", "w2")),
    blocks="megatrain.models.mixtral.blocks",
)
