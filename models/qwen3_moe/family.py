"""Qwen3-MoE: config rules, parameter table, on-disk names and presets. Pure stdlib.

Rules (transformers' ``Qwen3MoeConfig``): Qwen3's attention (q/k norm; ``attention_bias`` on q, k, v and o;
``sliding_window`` on every layer when ``use_sliding_window``); the MLP is sparse on every layer
(``decoder_sparse_step`` 1, no ``mlp_only_layers``; other layouts refused): ``num_experts`` (written as
``num_local_experts``; absent: 128) experts of width ``moe_intermediate_size`` (absent: 768),
``num_experts_per_tok`` (absent: 8) per token, top-k weights renormalised when ``norm_topk_prob`` (absent: false);
experts registered before the router. On disk: ``mlp.experts.N.gate_proj/up_proj/down_proj`` and ``mlp.gate``.
``max_position_embeddings`` absent: 32768.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config_fields import attention_biases, boolean, fixed_flag, integer, optional_integer
from ..family import Family, Preset
from ..moe import every_layer_sparse, expert_count, moe_layer, per_expert_names, read_experts, write_experts
from ..qwen2.family import DEFAULT_WINDOW

MODEL_TYPE = "qwen3_moe"
QWEN_MOE_DISK = per_expert_names("mlp", ("gate_proj", "up_proj", "down_proj"))


def read(data: Mapping[str, Any], num_hidden_layers: int) -> dict[str, Any]:
    every_layer_sparse(MODEL_TYPE, data)
    experts = expert_count(MODEL_TYPE, data, ("num_local_experts", "num_experts"), 128)
    return {**attention_biases(MODEL_TYPE, data, mlp=False), "qk_norm": fixed_flag(MODEL_TYPE, data, "qk_norm", True),
            "sliding_window": window(data), "layer_types": None,
            **read_experts(MODEL_TYPE, data, experts=experts,
                           width=integer("moe_intermediate_size", data.get("moe_intermediate_size", 768)),
                           norm_topk_prob=boolean("norm_topk_prob", data.get("norm_topk_prob", False)))}


def window(data: Mapping[str, Any]) -> int | None:
    """Qwen3-MoE's window: ``sliding_window`` on every layer when ``use_sliding_window`` (transformers' Qwen3-MoE
    reads no ``layer_types``), else none."""
    use = boolean("use_sliding_window", data.get("use_sliding_window", False))
    return optional_integer("sliding_window", data.get("sliding_window", DEFAULT_WINDOW)) if use else None


def write(config: Any) -> dict[str, Any]:
    return {"attention_bias": config.attention_bias, "use_sliding_window": config.sliding_window is not None,
            "sliding_window": config.sliding_window, "num_local_experts": config.num_experts,
            "moe_intermediate_size": config.moe_intermediate_size, "norm_topk_prob": config.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": [], **write_experts(config)}


def layer(dims: Mapping[str, Any]) -> tuple[Any, ...]:
    return moe_layer(dims, router_first=False)


def _qwen3_moe(name: str, h: int, layers: int, heads: int, width: int) -> Preset:
    return Preset(name, {
        "model_type": MODEL_TYPE, "hidden_size": h, "intermediate_size": 3 * h, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": False, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": width, "norm_topk_prob": True})


FAMILY = Family(
    model_type=MODEL_TYPE, architecture="Qwen3MoeForCausalLM", read=read, write=write,
    defaults={"max_position_embeddings": 32768},
    presets=(_qwen3_moe("Qwen3-30B-A3B", 2048, 48, 32, 768), _qwen3_moe("Qwen3-235B-A22B", 4096, 94, 64, 1536)),
    layer=layer, layer_disk_tensors=QWEN_MOE_DISK, blocks="megatrain.models.qwen3_moe.blocks",
)
