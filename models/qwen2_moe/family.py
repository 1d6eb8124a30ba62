"""Qwen2-MoE: config rules, parameter table, on-disk names and presets. Pure stdlib.

Rules (transformers' ``Qwen2MoeConfig``): Qwen2's attention with the bias of q, k and v from ``qkv_bias``
(absent: true), none on o, no q/k norm, Qwen2's sliding-window rule; the MLP is sparse on every layer (other
layouts refused): ``num_experts`` (absent: 60) experts of width ``moe_intermediate_size`` (absent: 1408),
``num_experts_per_tok`` (absent: 4), ``norm_topk_prob`` (absent: false), and a shared expert of width
``shared_expert_intermediate_size`` (absent: 5632) scaled by sigmoid(``shared_expert_gate``); router before
experts. On disk: ``mlp.experts.N.gate_proj/up_proj/down_proj``. ``max_position_embeddings`` absent: 32768.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config_fields import attention_biases, boolean, fixed_flag, integer
from ..errors import HFConfigError
from ..family import Family
from ..moe import every_layer_sparse, moe_layer, read_experts, write_experts
from ..qwen2.family import sliding_window, window_fields
from ..qwen3_moe.family import QWEN_MOE_DISK

MODEL_TYPE = "qwen2_moe"


def read(data: Mapping[str, Any], num_hidden_layers: int) -> dict[str, Any]:
    every_layer_sparse(MODEL_TYPE, data)
    shared = integer("shared_expert_intermediate_size", data.get("shared_expert_intermediate_size", 5632))
    if shared < 1:
        raise HFConfigError(f"shared_expert_intermediate_size={shared} must be a positive integer; fix it in the "
                            "config")
    qkv = boolean("qkv_bias", data.get("qkv_bias", True))
    return {**attention_biases(MODEL_TYPE, data, qkv=qkv, o=False, mlp=False),
            "qk_norm": fixed_flag(MODEL_TYPE, data, "qk_norm", False),
            "sliding_window": sliding_window(data, num_hidden_layers),
            **read_experts(MODEL_TYPE, data, experts=integer("num_experts", data.get("num_experts", 60)),
                           width=integer("moe_intermediate_size", data.get("moe_intermediate_size", 1408)),
                           norm_topk_prob=boolean("norm_topk_prob", data.get("norm_topk_prob", False)),
                           shared=shared)}


def write(config: Any) -> dict[str, Any]:
    return {"qkv_bias": config.attention_bias, **window_fields(config), "num_experts": config.num_experts,
            "moe_intermediate_size": config.moe_intermediate_size, "norm_topk_prob": config.norm_topk_prob,
            "shared_expert_intermediate_size": config.shared_expert_intermediate_size, "decoder_sparse_step": 1,
            "mlp_only_layers": [], **write_experts(config)}


def layer(dims: Mapping[str, Any]) -> tuple[Any, ...]:
    return moe_layer(dims, router_first=True)


FAMILY = Family(
    model_type=MODEL_TYPE, architecture="Qwen2MoeForCausalLM", read=read, write=write,
    defaults={"max_position_embeddings": 32768},
    layer=layer, layer_disk_tensors=QWEN_MOE_DISK, blocks="megatrain.models.qwen2_moe.blocks",
)
