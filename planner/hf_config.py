"""The one reader of a Hugging Face ``config.json``: every field the blocks depend on, honoured or refused.

Both the planner (``model_shapes.from_config``) and the runtime (``ModelConfig.from_hf``)
read a config through ``parse`` (a dict) or ``read`` (a path), so they cannot disagree on
what a config means. The rules are those of transformers' ``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` and ``MistralForCausalLM``: a field is either
honoured as transformers honours it, or refused with one line that names it and says
how to fix it. A field of the wrong JSON type (``"rms_norm_eps": "1e-6"``, ``null`` where
a number is needed) is refused the same way. Numeric ranges (a positive ``rope_theta``,
...) are the consumer's to check.

Audit of the fields (F = family: llama, qwen2, qwen3, mistral):

=================================  ===========================================================
field                              rule
=================================  ===========================================================
model_type                         llama, qwen2, qwen3, mistral (absent: llama); others refused
vocab_size, hidden_size,           required integers
intermediate_size,
num_hidden_layers,
num_attention_heads
num_key_value_heads                integer; null or absent: num_attention_heads
head_dim                           integer; null or absent: hidden_size // num_attention_heads
                                   (qwen3: 128, as transformers' Qwen3Config)
hidden_act                         silu, swish, gelu, gelu_pytorch_tanh, relu (transformers'
                                   ACT2FN); absent: silu; any other name refused
rms_norm_eps                       number (absent: 1e-6); null or a string refused
rope_theta, rope_scaling,          both spellings; rope_scaling wins when both are set, as in
rope_parameters                    transformers; rope_type default, linear, llama3, dynamic
                                   (NTK by sequence length over max_position_embeddings), yarn
                                   (attention_factor, beta_fast, beta_slow, mscale,
                                   mscale_all_dim, truncate as transformers reads them) honoured
                                   (llama3's and yarn's original_max_position_embeddings default
                                   to max_position_embeddings); other types and per-layer RoPE
                                   refused; factors must be numbers
partial_rotary_factor              1.0 honoured (top level or in the RoPE dict); other refused
tie_word_embeddings                boolean (absent: false)
attention_bias                     llama, qwen3: bias on q, k, v and o; qwen2: q, k, v always
                                   have a bias and o none (false refused); mistral: no bias
                                   (true refused)
mlp_bias                           llama: bias on gate, up, down; others have none (true
                                   refused)
sliding_window,                    llama: full attention (transformers' Llama has no window);
use_sliding_window,                mistral: sliding_window (absent: 4096, null: none); qwen2,
max_window_layers, layer_types     qwen3: a window only when use_sliding_window is true, on the
                                   layers that layer_types names sliding_attention (absent:
                                   layers >= max_window_layers, default 28); no sliding layer
                                   means full attention
attention_dropout                  0 honoured; any other value refused (megatrain trains
                                   without attention dropout)
max_position_embeddings            integer (absent: the family's transformers default)
pad_token_id                       integer or null: the embedding's padding row
initializer_range                  number (absent: 0.02): random initialisation only
o_proj_bias, qk_norm               megatrain's own names (``ModelConfig.to_dict()``): accepted
                                   when they agree with the family's rule, else refused
pretraining_tp, use_cache,         do not change transformers' training forward: not read
bos/eos_token_id, dtype,
torch_dtype, architectures
=================================  ===========================================================

Pure stdlib. Errors are ``HFConfigError`` (a ``ValueError``), one line each.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from megatrain.errors import MegatrainError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn")
# transformers' ACT2FN names whose function megatrain's blocks implement.
SUPPORTED_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu")

# Parameters each supported RoPE type needs, besides rope_type (rope_theta travels separately).
ROPE_TYPE_FIELDS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
}
# Parameters a RoPE type may carry (kept only when given and not null), with their JSON type.
ROPE_TYPE_OPTIONAL: dict[str, tuple[tuple[str, str], ...]] = {
    "yarn": (("attention_factor", "number"), ("beta_fast", "number"), ("beta_slow", "number"),
             ("mscale", "number"), ("mscale_all_dim", "number"), ("truncate", "boolean")),
}

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# transformers' defaults per family, for configs that leave the field out.
_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "mistral": 131072}
_DEFAULT_WINDOW = 4096
_DEFAULT_MAX_WINDOW_LAYERS = 28
_LAYER_TYPES = ("full_attention", "sliding_attention")


class HFConfigError(MegatrainError):
    """A config.json (or one of its fields) cannot be used. One line: the field, the value, the fix."""


@dataclass(frozen=True)
class DecoderConfig:
    """What the blocks of a decoder are, read from a config.json. Field names are ``ModelConfig``'s.

    ``head_dim=None``: ``hidden_size // num_attention_heads``. ``sliding_window``: the window of
    the sliding layers, ``None`` when every layer attends to the whole sequence.
    ``rope_scaling``: ``None`` (plain RoPE) or ``{"rope_type": "linear" | "llama3" | "dynamic" |
    "yarn", ...}`` holding that type's parameters (yarn's optional ones only when given).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None
    hidden_act: str
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    pad_token_id: int | None
    sliding_window: int | None
    initializer_range: float

    def fields(self) -> dict[str, Any]:
        """The fields as keyword arguments (``ModelConfig(**d.fields())``)."""
        return asdict(self)


# ---- typed field access ------------------------------------------------------------------------


def integer(name: str, value: Any) -> int:
    """``value`` as a JSON integer (not a bool, not a float), or one line naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise HFConfigError(f"{name}={value!r} must be an integer; fix it in the config")
    return value


def number(name: str, value: Any) -> float:
    """``value`` as a JSON number (int or float, not a bool, not a string), or one line naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HFConfigError(f"{name}={value!r} must be a number, not {_json_type(value)}; fix it in the config")
    return float(value)


def boolean(name: str, value: Any) -> bool:
    """``value`` as a JSON boolean, or one line naming ``name``."""
    if not isinstance(value, bool):
        raise HFConfigError(f"{name}={value!r} must be true or false; fix it in the config")
    return value


def optional_integer(name: str, value: Any) -> int | None:
    return None if value is None else integer(name, value)


def activation(name: str, value: Any) -> str:
    """A supported ``hidden_act``, or one line naming it and the supported ones."""
    if value not in SUPPORTED_ACTIVATIONS:
        raise HFConfigError(f"{name}={value!r} is not supported; megatrain implements "
                            f"{', '.join(SUPPORTED_ACTIVATIONS)}")
    return value


def rope_scaling(value: Any, max_position_embeddings: int | None = None,
                 name: str = "rope_scaling") -> dict[str, Any] | None:
    """A RoPE scaling dict normalised to ``{"rope_type": ..., <that type's parameters>}``, or None for plain RoPE.

    Accepts the old ``type`` key; ``rope_theta`` inside the dict is not part of the result (see
    ``read_rope``). A missing llama3 / yarn ``original_max_position_embeddings`` defaults to
    ``max_position_embeddings`` when that is given, as transformers does.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise HFConfigError(f"{name}={value!r} must be an object like {{\"rope_type\": \"linear\", \"factor\": 2.0}} "
                            "or null")
    if any(isinstance(v, Mapping) for v in value.values()):
        raise HFConfigError(f"{name} holds one RoPE per layer type, which megatrain does not support; "
                            "use one RoPE for every layer")
    rope_type = value.get("rope_type", value.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise HFConfigError(f"{name} type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = value.get("partial_rotary_factor", 1.0)
    if partial is not None and number(f"{name}.partial_rotary_factor", partial) != 1.0:
        raise HFConfigError(f"{name}.partial_rotary_factor={partial!r} (rotary on part of each head) is not "
                            "supported; megatrain rotates the whole head_dim (1.0)")
    if rope_type == "default":
        return None
    needed = ROPE_TYPE_FIELDS[rope_type]
    out: dict[str, Any] = {"rope_type": rope_type}
    for key in needed:
        if key in value:
            out[key] = value[key]
        elif key == "original_max_position_embeddings" and max_position_embeddings is not None:
            out[key] = max_position_embeddings
    missing = [k for k in needed if k not in out]
    if missing:
        raise HFConfigError(f"{name} of type {rope_type!r} lacks {', '.join(missing)}; add them to the config")
    for key in needed:
        if key == "original_max_position_embeddings":
            integer(f"{name}.{key}", out[key])
        else:
            out[key] = number(f"{name}.{key}", out[key])
    for key, kind in ROPE_TYPE_OPTIONAL.get(rope_type, ()):
        if value.get(key) is not None:
            out[key] = boolean(f"{name}.{key}", value[key]) if kind == "boolean" else number(f"{name}.{key}", value[key])
    return out


def read_rope(data: Mapping[str, Any], max_position_embeddings: int | None) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and the normalised scaling from either spelling.

    Older configs carry ``rope_theta`` + ``rope_scaling``; transformers 5 writes ``rope_parameters``
    (with ``rope_theta`` inside). As in transformers, a non-empty ``rope_scaling`` is used before
    ``rope_parameters``, and the dict's ``rope_theta`` before the top-level one.
    """
    scaling = data.get("rope_scaling")
    params = data.get("rope_parameters")
    name = "rope_scaling"
    if not scaling:
        scaling, name = params, "rope_parameters"
    if scaling is not None and not isinstance(scaling, Mapping):
        raise HFConfigError(f"{name}={scaling!r} must be an object or null; fix it in the config")
    scaling = dict(scaling or {})
    theta = scaling.pop("rope_theta", None)
    if theta is None:
        theta = data.get("rope_theta", 10000.0)
    theta = number("rope_theta", theta)
    top_partial = data.get("partial_rotary_factor")
    if top_partial is not None:
        scaling.setdefault("partial_rotary_factor", top_partial)
    return theta, rope_scaling(scaling, max_position_embeddings, name)


# ---- the reader --------------------------------------------------------------------------------


def read_config_json(source: str | os.PathLike) -> dict[str, Any]:
    """The parsed JSON object of a config.json (a path to it, or the directory holding it)."""
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise HFConfigError(f"no config.json at {path}; pass a Hugging Face model directory or its config.json") from None
    except OSError as e:
        raise HFConfigError(f"cannot read {path}: {e.strerror}; check the path and permissions") from None
    except UnicodeDecodeError:
        raise HFConfigError(f"{path} is not UTF-8 text; pass a Hugging Face config.json") from None
    except json.JSONDecodeError as e:
        raise HFConfigError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); fix or re-download it") from None
    if not isinstance(data, dict):
        raise HFConfigError(f"{path} holds a JSON {_json_type(data)}, not a config object")
    return data


def read(source: str | os.PathLike) -> DecoderConfig:
    """``parse`` of the config.json at ``source``; errors name the file."""
    data = read_config_json(source)
    try:
        return parse(data)
    except HFConfigError as e:
        raise HFConfigError(f"{os.fspath(source)}: {e}") from None


def parse(data: Mapping[str, Any]) -> DecoderConfig:
    """The decoder a Hugging Face config dict describes, with transformers' rules for its family."""
    if not isinstance(data, Mapping):
        raise HFConfigError(f"a model config is a JSON object, got {_json_type(data)}; pass a config.json")
    mtype = data.get("model_type", "llama")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise HFConfigError(f"model_type={mtype!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    missing = [k for k in _REQUIRED if data.get(k) is None]
    if missing:
        raise HFConfigError(f"config lacks {', '.join(missing)}; is it a causal language model config?")
    sizes = {k: integer(k, data[k]) for k in _REQUIRED}
    heads = sizes["num_attention_heads"]
    kv = optional_integer("num_key_value_heads", data.get("num_key_value_heads"))
    head_dim = optional_integer("head_dim", data.get("head_dim", 128 if mtype == "qwen3" else None))
    max_pos = integer("max_position_embeddings", data.get("max_position_embeddings", _MAX_POSITIONS[mtype]))
    theta, scaling = read_rope(data, max_pos)
    eps = number("rms_norm_eps", data.get("rms_norm_eps", 1e-6))
    dropout = number("attention_dropout", data.get("attention_dropout", 0.0))
    if dropout != 0.0:
        raise HFConfigError(f"attention_dropout={data['attention_dropout']!r} is not supported; megatrain trains "
                            "without attention dropout: set it to 0.0")
    attention_bias, o_proj_bias, mlp_bias = _biases(mtype, data)
    qk_norm = mtype == "qwen3"
    if "qk_norm" in data and boolean("qk_norm", data["qk_norm"]) != qk_norm:
        raise HFConfigError(f"qk_norm={data['qk_norm']!r} does not fit model_type={mtype!r} "
                            f"(qk_norm is {str(qk_norm).lower()} for it); remove the field or change model_type")
    return DecoderConfig(
        model_type=mtype,
        **sizes,
        num_key_value_heads=heads if kv is None else kv,
        head_dim=head_dim,
        hidden_act=activation("hidden_act", data.get("hidden_act", "silu")),
        rms_norm_eps=eps,
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=boolean("tie_word_embeddings", data.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        o_proj_bias=o_proj_bias,
        mlp_bias=mlp_bias,
        qk_norm=qk_norm,
        max_position_embeddings=max_pos,
        pad_token_id=optional_integer("pad_token_id", data.get("pad_token_id")),
        sliding_window=_sliding_window(mtype, data, sizes["num_hidden_layers"]),
        initializer_range=number("initializer_range", data.get("initializer_range", 0.02)),
    )


def _biases(mtype: str, data: Mapping[str, Any]) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o_proj bias, MLP bias) as transformers builds them for ``mtype``."""
    attn = data.get("attention_bias")
    mlp = data.get("mlp_bias")
    attn = None if attn is None else boolean("attention_bias", attn)
    mlp = None if mlp is None else boolean("mlp_bias", mlp)
    if mtype == "llama":
        qkv, o, m = bool(attn), bool(attn), bool(mlp)
    elif mtype == "qwen3":
        qkv, o, m = bool(attn), bool(attn), False
    elif mtype == "qwen2":
        qkv, o, m = True, False, False
    else:  # mistral
        qkv, o, m = False, False, False
    if attn is not None and attn != qkv:
        raise HFConfigError(f"attention_bias={str(attn).lower()} does not fit model_type={mtype!r}, whose q/k/v "
                            f"projections {'always' if qkv else 'never'} have a bias; remove the field or change "
                            "model_type")
    if mlp is not None and mlp != m:
        raise HFConfigError(f"mlp_bias=true does not fit model_type={mtype!r}, whose MLP has no bias; remove the "
                            "field or use model_type 'llama'")
    given_o = data.get("o_proj_bias")
    if given_o is not None and boolean("o_proj_bias", given_o) != o:
        raise HFConfigError(f"o_proj_bias={str(given_o).lower()} does not fit model_type={mtype!r} "
                            f"(o_proj has {'a' if o else 'no'} bias there); remove the field or change model_type")
    return qkv, o, m


def _sliding_window(mtype: str, data: Mapping[str, Any], layers: int) -> int | None:
    """The window of the sliding layers, or None when every layer attends to the whole sequence."""
    if mtype == "llama":
        return None
    window = optional_integer("sliding_window", data.get("sliding_window", _DEFAULT_WINDOW))
    if mtype == "mistral" or window is None:
        return window
    if not boolean("use_sliding_window", data.get("use_sliding_window", False)):
        return None
    types = data.get("layer_types")
    if types is None:
        first = integer("max_window_layers", data.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS))
        return window if first < layers else None
    if not isinstance(types, list) or any(t not in _LAYER_TYPES for t in types):
        raise HFConfigError(f"layer_types={types!r} must be a list of {' or '.join(map(repr, _LAYER_TYPES))}; "
                            "fix it in the config")
    return window if "sliding_attention" in types else None


def _json_type(value: Any) -> str:
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
