"""Every check of a ``ModelConfig``'s values, in one place, run once on construction. Pure stdlib.

``checked`` takes the fields as given and returns them as kept (defaults resolved: ``num_key_value_heads`` the
head count, ``o_proj_bias`` ``attention_bias``, ``head_dim`` hidden / heads; numbers as floats; an out-of-range
``pad_token_id`` None, as Hugging Face treats it) or raises ``ConfigError`` in one line naming the field, the value
and what it must be. In order: each field's type (before any arithmetic on it), the family (``model_type``) and its
own fields (``Family.fields``, each with its declared check), then ranges and how fields fit together (heads and
key-value heads, head_dim and RoPE, the sparse MLP). Non-finite numbers are refused: one NaN or infinity in the
model's configuration turns every weight into NaN.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from . import registry
from .config_fields import activation, boolean, layer_types, number, optional_integer
from .errors import ConfigError
from .family import Family
from .hf_config import rope_scaling

POSITIVE_INTEGERS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings")
OPTIONAL_INTEGERS = ("num_key_value_heads", "head_dim", "pad_token_id", "sliding_window")
NUMBERS = ("rope_theta", "rms_norm_eps", "initializer_range")
FLAGS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "qk_norm", "norm_topk_prob")
EXPERT_COUNTS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


def checked(values: dict[str, Any], own: Any, keywords: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``values`` (the shared fields) and the family's (``own``, a ``family_fields`` mapping or None, and
    ``keywords``, given as keywords of their own) as a ``ModelConfig`` keeps them, checked."""
    v = dict(values)
    if own is not None and not isinstance(own, Mapping):
        raise ConfigError(f"family_fields={own!r} must be a mapping of the family's own fields by name, e.g. "
                          "{'query_pre_attn_scalar': 168.0}, or None")
    own = {**(own or {}), **keywords}
    _types(v)
    family = registry.find(v["model_type"])
    if family is None:
        raise ConfigError(f"model_type={v['model_type']!r} is not supported; supported: "
                          f"{', '.join(registry.model_types())}")
    own = family_fields(family, own)
    if v["num_key_value_heads"] is None:
        v["num_key_value_heads"] = v["num_attention_heads"]
    if v["o_proj_bias"] is None:
        v["o_proj_bias"] = v["attention_bias"]
    for name in NUMBERS:
        v[name] = float(v[name])
    v["rope_scaling"] = rope_scaling(v["rope_scaling"], v["max_position_embeddings"])
    _ranges(v)
    if v["head_dim"] is None:
        v["head_dim"] = v["hidden_size"] // v["num_attention_heads"]
    if v["pad_token_id"] is not None and not 0 <= v["pad_token_id"] < v["vocab_size"]:
        v["pad_token_id"] = None  # Hugging Face treats an out-of-range pad id as absent for the embedding
    return v, own


def family_fields(family: Family, given: Mapping[str, Any]) -> dict[str, Any]:
    """The family's own fields: each given value (absent: its declared default) through its declared check. A
    field the family does not declare is refused, unless None (absent: a config written before that field was its
    family's own holds it so)."""
    declared = {f.name: f for f in family.fields}
    stray = [k for k, value in given.items() if k not in declared and value is not None]
    if stray:
        own = ", ".join(declared) or "none"
        raise ConfigError(f"{stray[0]}={given[stray[0]]!r} is not a field of model_type={family.model_type!r} (its "
                          f"own fields: {own}); remove it or change model_type")
    return {name: f.check(name, given.get(name, f.default)) for name, f in declared.items()}


def _types(v: dict[str, Any]) -> None:
    """Every shared field of the right type, before any arithmetic on it."""
    for name in POSITIVE_INTEGERS:
        value = v[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer")
    for name in OPTIONAL_INTEGERS:
        optional_integer(name, v[name])
    for name in NUMBERS:
        number(name, v[name])
    for name in FLAGS:
        boolean(name, v[name])
    if v["o_proj_bias"] is not None:
        boolean("o_proj_bias", v["o_proj_bias"])
    for name in EXPERT_COUNTS:
        value = v[name]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{name}={value!r} must be an integer >= 0")
    if v["router_aux_loss_coef"] is not None:
        number("router_aux_loss_coef", v["router_aux_loss_coef"])
    if v["layer_types"] is not None:
        v["layer_types"] = layer_types("layer_types", v["layer_types"], v["num_hidden_layers"])
    activation("hidden_act", v["hidden_act"])


def _ranges(v: dict[str, Any]) -> None:
    """Numeric ranges and how the fields fit together (types already checked)."""
    _finite("rope_theta", v["rope_theta"], 0, strict=True, hint=", e.g. 10000.0")
    _finite("rms_norm_eps", v["rms_norm_eps"], 0, strict=True, hint=", e.g. 1e-6")
    _finite("initializer_range", v["initializer_range"], 0, strict=False, hint=", e.g. 0.02")
    if v["sliding_window"] is not None and v["sliding_window"] < 1:
        raise ConfigError(f"sliding_window={v['sliding_window']!r} must be an integer >= 1 or None (None: full "
                          "attention)")
    kv, heads = v["num_key_value_heads"], v["num_attention_heads"]
    if kv < 1:
        raise ConfigError(f"num_key_value_heads={kv!r} must be an integer >= 1 or None")
    if heads % kv != 0:
        raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}; choose "
                          f"num_key_value_heads among the divisors of {heads}: {_divisors(heads)}")
    if v["head_dim"] is None:
        if v["hidden_size"] % heads != 0:
            raise ConfigError(f"hidden_size={v['hidden_size']} is not divisible by num_attention_heads={heads}; set "
                              f"head_dim explicitly or choose num_attention_heads among {_divisors(v['hidden_size'])}")
    elif v["head_dim"] < 2:
        raise ConfigError(f"head_dim={v['head_dim']!r} must be an integer >= 2 or None")
    elif v["head_dim"] % 2:
        raise ConfigError(f"head_dim={v['head_dim']!r} must be an even integer >= 2 (rotary embeddings pair "
                          "dimensions)")
    _experts(v)
    _rope_scaling(v["rope_scaling"])


def _experts(v: dict[str, Any]) -> None:
    """The sparse MLP's fields together (``moe.py``): top-k among the experts, a width, an aux loss only there."""
    e, k = v["num_experts"], v["num_experts_per_tok"]
    if e and not (1 <= k <= e and v["moe_intermediate_size"]):
        raise ConfigError(f"num_experts_per_tok={k} must be in 1..num_experts={e} and moe_intermediate_size "
                          "positive for a sparse MLP")
    coef = v["router_aux_loss_coef"]
    if coef is not None and not e:
        raise ConfigError(f"router_aux_loss_coef={coef!r} weighs the load-balancing loss of a sparse MLP; set it to "
                          "None for a dense model (num_experts=0)")
    if coef is not None:
        _finite("router_aux_loss_coef", coef, 0, strict=False, hint=" or None (no aux loss)")


def _rope_scaling(scaling: Mapping[str, Any] | None) -> None:
    """A normalised ``rope_scaling`` (``hf_config.rope_scaling``: its type and keys): its factors in range."""
    if scaling is None:
        return
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key in scaling:
            _finite(f"rope_scaling[{key!r}]", scaling[key], 0, strict=True)
    if "original_max_position_embeddings" in scaling and scaling["original_max_position_embeddings"] < 1:
        raise ConfigError(f"rope_scaling['original_max_position_embeddings']="
                          f"{scaling['original_max_position_embeddings']!r} must be an integer >= 1")
    low, high = scaling.get("low_freq_factor"), scaling.get("high_freq_factor")
    if low is not None and high is not None and not high > low:
        raise ConfigError(f"rope_scaling has high_freq_factor={high!r} <= low_freq_factor={low!r}; "
                          "llama3 scaling needs high > low (e.g. 4.0 and 1.0)")


def _finite(name: str, value: float, low: float, *, strict: bool, hint: str = "") -> None:
    """A finite number > low (strict) or >= low."""
    if not math.isfinite(value) or (value <= low if strict else value < low):
        raise ConfigError(f"{name}={value!r} must be a finite number {'>' if strict else '>='} {low:g}{hint}")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
