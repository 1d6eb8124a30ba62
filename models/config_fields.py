"""Typed access to config.json fields, and the rules several families share (biases, fixed flags).

Each accessor returns the value as its JSON type or raises ``HFConfigError`` with one line naming the
field. ``attention_biases`` and ``fixed_flag`` are how a family states which biases and switches transformers
builds for it, refusing a config that says otherwise. Pure stdlib.
"""
from __future__ import annotations

from typing import Any, Mapping

from .errors import HFConfigError

# transformers' ACT2FN names whose function the shared MLP implements (layers/decoder.py).
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu")
# transformers' ``layer_types``: what each decoder layer's attention is.
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


def integer(name: str, value: Any) -> int:
    """``value`` as a JSON integer (not a bool, not a float), or one line naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise HFConfigError(f"{name}={value!r} must be an integer; fix it in the config")
    return value


def number(name: str, value: Any) -> float:
    """``value`` as a JSON number (int or float, not a bool, not a string), or one line naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HFConfigError(f"{name}={value!r} must be a number, not {json_type(value)}; fix it in the config")
    return float(value)


def boolean(name: str, value: Any) -> bool:
    """``value`` as a JSON boolean, or one line naming ``name``."""
    if not isinstance(value, bool):
        raise HFConfigError(f"{name}={value!r} must be true or false; fix it in the config")
    return value


def optional_integer(name: str, value: Any) -> int | None:
    return None if value is None else integer(name, value)


def optional_positive(name: str, value: Any) -> float | None:
    """``value`` as a positive finite number (a float), or None; else one line naming ``name``."""
    if value is not None and not 0 < number(name, value) < float("inf"):
        raise HFConfigError(f"{name}={value!r} must be a positive finite number, or None")
    return None if value is None else float(value)


def layer_types(name: str, value: Any, layers: int) -> tuple[str, ...]:
    """``value`` as one of ``LAYER_TYPES`` per decoder layer, or one line naming ``name``."""
    if not isinstance(value, (list, tuple)) or len(value) != layers or any(t not in LAYER_TYPES for t in value):
        raise HFConfigError(f"{name}={value!r} must list {layers} layer types, each "
                            f"{' or '.join(map(repr, LAYER_TYPES))}; fix it in the config")
    return tuple(value)


def layer_windows(window: int | None, types: tuple[str, ...]) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` of a model whose layers are ``types`` and whose sliding layers see the
    last ``window`` positions (None: none slides). Layers all alike: ``layer_types`` None (every layer slides when
    ``sliding_window`` is set, none when it is None)."""
    if window is None or SLIDING_ATTENTION not in types:
        return {"sliding_window": None, "layer_types": None}
    return {"sliding_window": window, "layer_types": None if FULL_ATTENTION not in types else types}


def activation(name: str, value: Any) -> str:
    """A supported ``hidden_act``, or one line naming it and the supported ones."""
    if value not in SUPPORTED_ACTIVATIONS:
        raise HFConfigError(f"{name}={value!r} is not supported; megatrain implements "
                            f"{', '.join(SUPPORTED_ACTIVATIONS)}")
    return value


def attention_biases(model_type: str, data: Mapping[str, Any], *, qkv: bool | None = None, o: bool | None = None,
                     mlp: bool | None = None) -> dict[str, bool]:
    """``attention_bias``, ``o_proj_bias`` and ``mlp_bias`` as transformers builds them for ``model_type``.

    ``qkv``, ``o``, ``mlp``: the family's fixed answer, or None where the config decides (``o`` None: the same as
    q, k and v). A config that states another answer than a fixed one is refused.
    """
    attn = data.get("attention_bias")
    given_mlp = data.get("mlp_bias")
    attn = None if attn is None else boolean("attention_bias", attn)
    given_mlp = None if given_mlp is None else boolean("mlp_bias", given_mlp)
    qkv_bias = bool(attn) if qkv is None else qkv
    o_bias = qkv_bias if o is None else o
    mlp_bias = bool(given_mlp) if mlp is None else mlp
    if attn is not None and attn != qkv_bias:
        raise HFConfigError(f"attention_bias={str(attn).lower()} does not fit model_type={model_type!r}, whose q/k/v "
                            f"projections {'always' if qkv_bias else 'never'} have a bias; remove the field or change "
                            "model_type")
    if given_mlp is not None and given_mlp != mlp_bias:
        raise HFConfigError(f"mlp_bias=true does not fit model_type={model_type!r}, whose MLP has no bias; remove the "
                            "field or use model_type 'llama'")
    given_o = data.get("o_proj_bias")
    if given_o is not None and boolean("o_proj_bias", given_o) != o_bias:
        raise HFConfigError(f"o_proj_bias={str(given_o).lower()} does not fit model_type={model_type!r} "
                            f"(o_proj has {'a' if o_bias else 'no'} bias there); remove the field or change model_type")
    return {"attention_bias": qkv_bias, "o_proj_bias": o_bias, "mlp_bias": mlp_bias}


def fixed_flag(model_type: str, data: Mapping[str, Any], name: str, value: bool) -> bool:
    """A switch that ``model_type`` fixes (``qk_norm``): ``value``, or one line when the config says otherwise."""
    if name in data and boolean(name, data[name]) != value:
        raise HFConfigError(f"{name}={data[name]!r} does not fit model_type={model_type!r} "
                            f"({name} is {str(value).lower()} for it); remove the field or change model_type")
    return value


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, Mapping):
        return "an object"
    return f"a {type(value).__name__}"
