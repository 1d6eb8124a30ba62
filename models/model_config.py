"""``ModelConfig``: the one description of a model, which the planner and the runtime both take. Pure stdlib.

Its fields are those every family has, by their Hugging Face ``config.json`` names, and the shared sparse MLP's
(``moe.py``); a family's own fields (Gemma 3's ``query_pre_attn_scalar``, ...) are declared by that family
(``Family.fields``) and held in ``family_fields``, read as attributes like the others. ``from_hf`` reads a
config.json by its family's rules (``hf_config``); every check of a value is ``model_config_checks``'s, run on
construction, so a ``ModelConfig`` that exists is valid. The planner's ``ModelShape`` is derived from one
(``model_shapes.of_model``); the runtime builds its blocks from one.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import hf_config, registry
from .model_config_checks import checked

__all__ = ["ModelConfig"]


@dataclass(frozen=True, init=False)
class ModelConfig:
    """A decoder of one of ``megatrain.models``' families (``model_type``). Field names follow Hugging Face
    ``config.json``; which of them a family sets, and how, is the family's (its ``read``).

    ``head_dim=None`` means ``hidden_size // num_attention_heads``. ``rope_scaling``
    is ``None`` (plain RoPE) or a dict with ``rope_type`` in ``linear`` / ``llama3`` / ``dynamic`` / ``yarn``
    and that type's parameters. ``qk_norm`` is an RMSNorm on queries and keys.
    ``attention_bias`` puts a bias on q, k and v; ``o_proj_bias`` (default: the same
    as ``attention_bias``) on the output projection. ``hidden_act`` is the MLP's activation, by its transformers ``ACT2FN`` name.
    ``sliding_window`` is the window of the sliding layers (``None``: full attention): each query sees the last
    ``sliding_window`` positions. ``layer_types`` is each layer's ``full_attention`` or ``sliding_attention``
    (``None``: every layer alike, sliding when ``sliding_window`` is set).
    ``num_experts`` > 0: the MLP is sparse (``megatrain.models.moe``): ``num_experts_per_tok`` experts of width
    ``moe_intermediate_size`` per token, top-k weights renormalised when ``norm_topk_prob``, and a shared expert
    of width ``shared_expert_intermediate_size`` when it is > 0; ``router_aux_loss_coef`` (None: none) the weight
    of the routers' load-balancing loss in the loss (transformers' ``output_router_logits``).

    ``family_fields``: the values of the fields the family declares (``Family.fields``), each also an attribute
    (``config.query_pre_attn_scalar``) and a keyword of the constructor (``ModelConfig(...,
    query_pre_attn_scalar=168.0)``); code that reads a field some families lack asks ``family_field``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool | None = None
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    pad_token_id: int | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    initializer_range: float = 0.02
    model_type: str = registry.DEFAULT_MODEL_TYPE
    hidden_act: str = "silu"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float | None = None
    family_fields: Mapping[str, Any] = field(default_factory=dict)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The fields above, by position or keyword; any other keyword is a field of the family's own
        (``family_fields``), checked against its declaration."""
        shared = [f for f in dataclasses.fields(self) if f.name != "family_fields"]
        if len(args) > len(shared):
            raise TypeError(f"ModelConfig takes at most {len(shared)} positional arguments ({len(args)} given)")
        given = {f.name: a for f, a in zip(shared, args)}
        own, keywords = kwargs.pop("family_fields", None), {}
        for name, value in kwargs.items():
            if name in given:
                raise TypeError(f"ModelConfig got multiple values for argument {name!r}")
            (given if name in self.__dataclass_fields__ else keywords)[name] = value
        missing = [f.name for f in shared if f.name not in given and f.default is dataclasses.MISSING]
        if missing:
            raise TypeError(f"ModelConfig missing required arguments: {', '.join(missing)}")
        values = {f.name: given.get(f.name, f.default) for f in shared}
        values, own = checked(values, own, keywords)
        values["rope_scaling"] = frozen(values["rope_scaling"])
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "family_fields", _FrozenDict(own))

    def __getattr__(self, name: str) -> Any:
        """A field of the family's own (``family_fields``) as an attribute."""
        own = self.__dict__.get("family_fields", {})
        if name in own:
            return own[name]
        raise AttributeError(f"ModelConfig of model_type={self.__dict__.get('model_type')!r} has no field {name!r}")

    def family_field(self, name: str, absent: Any = None) -> Any:
        """The family's own field ``name``, or ``absent`` when the family has no such field (the feature off)."""
        return self.family_fields.get(name, absent)

    # ---- derived sizes -------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim  # type: ignore[operator]

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim  # type: ignore[operator]

    def to_dict(self) -> dict[str, Any]:
        """Every field by its config name, the family's own among them (``ModelConfig(**d)`` builds it again)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "family_fields"}
        if self.rope_scaling is not None:
            d["rope_scaling"] = dict(self.rope_scaling)
        return {**d, **self.family_fields}

    # ---- Hugging Face config.json --------------------------------------
    @classmethod
    def from_hf(cls, source: str | os.PathLike | Mapping[str, Any]) -> "ModelConfig":
        """Read a Hugging Face ``config.json`` (a path to it, its directory, or the parsed dict).

        The rules for each field are ``megatrain.models.hf_config``'s (transformers' for the family).
        """
        reader = hf_config.fields if isinstance(source, Mapping) else hf_config.read_fields
        return cls(**reader(source))


class _FrozenDict(dict):
    """A dict that refuses mutation, so a frozen config stays frozen (and hashes)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("ModelConfig.rope_scaling and family_fields are read-only; build a new ModelConfig")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted((k, repr(v)) for k, v in self.items())))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled and copied whole (a dict's own way would set its items one by one)."""
        return _FrozenDict, (dict(self),)


def frozen(mapping: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``mapping`` as a read-only dict (None stays None)."""
    return None if mapping is None else _FrozenDict(mapping)
