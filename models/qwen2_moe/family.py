"""Qwen2-MoE: config rules, parameter table, on-disk names and presets. Pure stdlib.

Rules (transformers' ``Qwen2MoeConfig``): Qwen2's attention with the bias of q, k and v from ``qkv_bias`` (absent:
true), none on o, no q/k norm, windows on the even-numbered layers (``windows``); the MLP is sparse on every layer
(other layouts refused): ``num_experts`` (absent: 60) experts of width ``moe_intermediate_size`` (absent: 1408),
``num_experts_per_tok`` (absent: 4), ``norm_topk_prob`` (absent: false), and a shared expert of width
``shared_expert_intermediate_size`` (absent: 5632) scaled by sigmoid(``shared_expert_gate``); router before experts.
On disk: ``mlp.experts.N.gate_proj/up_proj/down_proj``. ``max_position_embeddings`` absent: 32768.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config_fields import (FULL_ATTENTION, SLIDING_ATTENTION, attention_biases, boolean, fixed_flag, integer,
                             layer_types, layer_windows, optional_integer)
from ..errors import HFConfigError
from ..family import Family
from ..moe import every_layer_sparse, expert_count, moe_layer, read_experts, write_experts
from ..qwen2.family import DEFAULT_MAX_WINDOW_LAYERS, DEFAULT_WINDOW
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
            **windows(data, num_hidden_layers),
            **read_experts(MODEL_TYPE, data, experts=expert_count(MODEL_TYPE, data, ("num_experts",), 60),
                           width=integer("moe_intermediate_size", data.get("moe_intermediate_size", 1408)),
                           norm_topk_prob=boolean("norm_topk_prob", data.get("norm_topk_prob", False)),
                           shared=shared)}


def windows(data: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` by Qwen2-MoE's rule: with ``use_sliding_window``, the layers
    ``layer_types`` names (absent: the even-numbered ones below ``max_window_layers``) see ``sliding_window``
    positions; without it a sliding layer would see none (transformers' window is then 0), so it is refused."""
    use = boolean("use_sliding_window", data.get("use_sliding_window", False))
    window = optional_integer("sliding_window", data.get("sliding_window", DEFAULT_WINDOW)) if use else None
    types = data.get("layer_types")
    if types is None:
        first = integer("max_window_layers", data.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS))
        types = [SLIDING_ATTENTION if use and i % 2 == 0 and i < first else FULL_ATTENTION for i in range(layers)]
    types = layer_types("layer_types", types, layers)
    if SLIDING_ATTENTION in types and not window:
        raise HFConfigError("layer_types names sliding layers but use_sliding_window is false or sliding_window "
                            "null (a window of 0 positions); set use_sliding_window and sliding_window")
    return layer_windows(window, types)


def write(config: Any) -> dict[str, Any]:
    slides = SLIDING_ATTENTION if config.sliding_window is not None else FULL_ATTENTION
    types = list(config.layer_types or [slides] * config.num_hidden_layers)
    return {"qkv_bias": config.attention_bias, "use_sliding_window": config.sliding_window is not None,
            "sliding_window": config.sliding_window, "max_window_layers": config.num_hidden_layers,
            "layer_types": types, "num_experts": config.num_experts,
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
