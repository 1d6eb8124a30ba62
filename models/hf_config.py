"""The one reader of a Hugging Face ``config.json``: every field the blocks depend on, honoured or refused.

Both the planner (``model_shapes.from_config``) and the runtime (``ModelConfig.from_hf``)
read a config through ``parse`` (a dict) or ``read`` (a path), so they cannot disagree on
what a config means. The rules are those of transformers' class for the config's family
(``megatrain.models``: each family's ``read`` holds the fields in which families differ): a
field is either honoured as transformers honours it, or refused with one line that names it and
says how to fix it. A field of the wrong JSON type (``"rms_norm_eps": "1e-6"``, ``null`` where
a number is needed) is refused the same way. Numeric ranges (a positive ``rope_theta``,
...) are the consumer's to check.

Audit of the fields (the family rules below are those of the built-in families, each in its folder of
``megatrain.models``):

=================================  ===========================================================
field                              rule
=================================  ===========================================================
model_type                         a registered family (``megatrain.models.registry``; absent: its
                                   DEFAULT_MODEL_TYPE); others refused
vocab_size, hidden_size,           required integers
intermediate_size,
num_hidden_layers,
num_attention_heads
num_key_value_heads                integer; null or absent: num_attention_heads
head_dim                           integer; null or absent: the family's default, else
                                   hidden_size // num_attention_heads
hidden_act                         silu, swish, gelu, gelu_pytorch_tanh, relu (transformers'
                                   ACT2FN); absent: silu; any other name refused
rms_norm_eps                       number (absent: the family's default, else 1e-6); null or a
                                   string refused
rope_theta, rope_scaling,          both spellings; rope_scaling wins when both are set, as in
rope_parameters                    transformers (absent: the family's default, e.g. gpt-oss's YaRN);
                                   rope_type default, linear, llama3, dynamic
                                   (NTK by sequence length over max_position_embeddings), yarn
                                   (attention_factor, beta_fast, beta_slow, mscale,
                                   mscale_all_dim, truncate as transformers reads them) honoured
                                   (llama3's and yarn's original_max_position_embeddings default
                                   to max_position_embeddings); other types refused; factors must
                                   be numbers. One RoPE per layer type only for a family with a
                                   local RoPE (``read_layer_ropes``), else refused
rope_local_base_freq               a family with a default for it (gemma3_text): the sliding layers'
                                   RoPE base, unscaled (also rope_parameters.sliding_attention, of
                                   the default type); absent: the family's default
partial_rotary_factor              1.0 honoured (top level or in the RoPE dict); other refused
tie_word_embeddings, pad_token_id  absent: the family's default, else false and null
attention_bias, mlp_bias,          the family's rule (its ``read``): which projections have a
o_proj_bias, qk_norm,              bias, whether q and k are normed, which layers slide and over
sliding_window,                    what window (no sliding layer: full attention); a field that
use_sliding_window,                contradicts the family is refused. ``o_proj_bias`` and
max_window_layers, layer_types,    ``qk_norm`` are megatrain's own names (``ModelConfig.to_dict()``)
sliding_window_pattern
num_experts, num_local_experts,    the family's rule (``megatrain.models.moe``): the experts of a
num_experts_per_tok,               sparse MLP, their width, top-k renormalisation, a shared
moe_intermediate_size,             expert; output_router_logits true: the load-balancing loss
norm_topk_prob, shared_expert_*,   weighted by router_aux_loss_coef (absent: 0.001); router
output_router_logits,              jitter refused; layers of another kind (mlp_only_layers,
router_aux_loss_coef,              decoder_sparse_step > 1) refused
decoder_sparse_step,
mlp_only_layers
query_pre_attn_scalar,             the family's rule (gemma3_text): the attention scale, the final
final_logit_softcapping,           logits' soft cap, hidden_activation read instead of hidden_act;
hidden_activation,                 attention soft-capping and bidirectional attention refused
attn_logit_softcapping,
use_bidirectional_attention
swiglu_alpha, swiglu_limit,        gpt_oss: the published 1.702 and 7.0 honoured, others refused; MXFP4
quantization_config                honoured (its expert tensors dequantized on load), other methods refused
attention_dropout                  0 honoured; any other value refused (megatrain trains
                                   without attention dropout)
max_position_embeddings            integer (absent: the family's transformers default)
pad_token_id                       integer or null: the embedding's padding row
initializer_range                  number (absent: 0.02): random initialisation only
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

from megatrain.models import registry
from megatrain.models.config_fields import (FULL_ATTENTION, LAYER_TYPES, SLIDING_ATTENTION, SUPPORTED_ACTIVATIONS,
                                            activation, boolean, integer, json_type, layer_types, number,
                                            optional_integer)
from megatrain.models.errors import HFConfigError

__all__ = ["HFConfigError", "DecoderConfig", "SUPPORTED_MODEL_TYPES", "SUPPORTED_ROPE_TYPES", "SUPPORTED_ACTIVATIONS",
           "integer", "number", "boolean", "optional_integer", "activation", "layer_types", "rope_scaling",
           "read_rope", "read_config_json", "read", "parse"]

# The built-in families (``megatrain.models.registry``; ``registry.model_types()`` adds those registered later).
SUPPORTED_MODEL_TYPES = registry.BUILTIN_MODEL_TYPES
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn")

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


@dataclass(frozen=True)
class DecoderConfig:
    """What the blocks of a decoder are, read from a config.json. Field names are ``ModelConfig``'s.

    ``head_dim=None``: ``hidden_size // num_attention_heads``. ``sliding_window``: the window of
    the sliding layers, ``None`` when every layer attends to the whole sequence; ``layer_types``: each
    layer's ``full_attention`` or ``sliding_attention``, ``None`` when every layer is alike.
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
    num_experts: int = 0  # the experts of a sparse MLP (megatrain.models.moe); 0: a dense MLP
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    layer_types: tuple[str, ...] | None = None
    rope_local_base_freq: float | None = None  # the sliding layers' RoPE base, unscaled; None: the full layers'
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    router_aux_loss_coef: float | None = None  # the load-balancing loss's weight; None: output_router_logits false

    def fields(self) -> dict[str, Any]:
        """The fields as keyword arguments (``ModelConfig(**d.fields())``)."""
        return asdict(self)


# ---- RoPE ------------------------------------------------------------------------------------------


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


def read_layer_ropes(data: Mapping[str, Any], max_position_embeddings: int,
                     defaults: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """rope_theta and scaling of the full-attention layers, and the sliding layers' unscaled base, as transformers'
    ``Gemma3TextConfig`` reads them: ``rope_parameters`` per layer type (``{"full_attention": {...},
    "sliding_attention": {...}}``), the old ``rope_scaling`` updating the full layers', ``rope_theta`` and
    ``rope_local_base_freq`` where a type's dict has no ``rope_theta`` (absent: the family's ``defaults``)."""
    params = data.get("rope_parameters")
    if params is not None and not (isinstance(params, Mapping) and all(isinstance(v, Mapping) or v is None
                                                                       for v in params.values())
                                   and set(params) <= set(LAYER_TYPES)):
        raise HFConfigError(f"rope_parameters={params!r} must hold one RoPE per layer type: "
                            '{"full_attention": {...}, "sliding_attention": {...}}; fix it in the config')
    full = dict((params or {}).get(FULL_ATTENTION) or {})
    local = dict((params or {}).get(SLIDING_ATTENTION) or {})
    if data.get("rope_scaling"):
        if not isinstance(data["rope_scaling"], Mapping):
            raise HFConfigError(f"rope_scaling={data['rope_scaling']!r} must be an object or null; fix it in the "
                                "config")
        full.update(data["rope_scaling"])
    full.setdefault("rope_theta", data.get("rope_theta", defaults["rope_theta"]))
    local.setdefault("rope_theta", data.get("rope_local_base_freq", defaults["rope_local_base_freq"]))
    theta, scaling = read_rope({"rope_parameters": full, "partial_rotary_factor": data.get("partial_rotary_factor")},
                               max_position_embeddings)
    local_theta, local_scaling = read_rope({"rope_parameters": local}, max_position_embeddings)
    if local_scaling is not None:
        raise HFConfigError(f"rope_parameters.sliding_attention of type {local_scaling['rope_type']!r} is not "
                            "supported; the sliding layers take the default RoPE with their own rope_theta")
    return theta, scaling, local_theta


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
        raise HFConfigError(f"{path} holds a JSON {json_type(data)}, not a config object")
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
        raise HFConfigError(f"a model config is a JSON object, got {json_type(data)}; pass a config.json")
    mtype = data.get("model_type", registry.DEFAULT_MODEL_TYPE)
    family = registry.family(mtype)
    missing = [k for k in _REQUIRED if data.get(k) is None]
    if missing:
        raise HFConfigError(f"config lacks {', '.join(missing)}; is it a causal language model config?")
    sizes = {k: integer(k, data[k]) for k in _REQUIRED}
    heads = sizes["num_attention_heads"]
    kv = optional_integer("num_key_value_heads", data.get("num_key_value_heads"))
    head_dim = optional_integer("head_dim", data.get("head_dim", family.defaults.get("head_dim")))
    max_pos = integer("max_position_embeddings",
                      data.get("max_position_embeddings", family.defaults.get("max_position_embeddings", 4096)))
    if family.defaults.get("rope_local_base_freq") is None:
        rope_defaults = family.defaults.get("rope", {})  # the family's RoPE where the config states none (gpt-oss)
        theta, scaling = read_rope({**data, **{k: v for k, v in rope_defaults.items() if data.get(k) is None}},
                                   max_pos)
        ropes: dict[str, Any] = {}
    else:  # a family whose sliding layers have their own RoPE
        theta, scaling, local = read_layer_ropes(data, max_pos, family.defaults)
        ropes = {"rope_local_base_freq": local}
    eps = number("rms_norm_eps", data.get("rms_norm_eps", family.defaults.get("rms_norm_eps", 1e-6)))
    dropout = number("attention_dropout", data.get("attention_dropout", 0.0))
    if dropout != 0.0:
        raise HFConfigError(f"attention_dropout={data['attention_dropout']!r} is not supported; megatrain trains "
                            "without attention dropout: set it to 0.0")
    own = family.read(data, sizes["num_hidden_layers"])  # may read the activation under its own name
    act = own.pop("hidden_act", None) or activation("hidden_act", data.get("hidden_act", "silu"))
    return DecoderConfig(
        model_type=mtype,
        **sizes,
        num_key_value_heads=heads if kv is None else kv,
        head_dim=head_dim,
        hidden_act=act,
        rms_norm_eps=eps,
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=boolean("tie_word_embeddings", data.get(
            "tie_word_embeddings", family.defaults.get("tie_word_embeddings", False))),
        max_position_embeddings=max_pos,
        pad_token_id=optional_integer("pad_token_id", data.get("pad_token_id", family.defaults.get("pad_token_id"))),
        initializer_range=number("initializer_range", data.get("initializer_range", 0.02)),
        **ropes,
        **own,
    )
