"""Model and optimizer configuration: frozen, validated, Hugging Face field names.

A ``config.json`` is read by the planner's ``hf_config`` (the one reader, shared with the
planner's model shapes); its module docstring holds the audit of every field: each is
honoured as transformers honours it or refused with one line.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

from megatrain.models import registry
from megatrain.models import hf_config
from megatrain.models.hf_config import SUPPORTED_ACTIVATIONS, SUPPORTED_MODEL_TYPES, SUPPORTED_ROPE_TYPES

from megatrain.runtime.config_ranges import check_model_ranges, check_optimizer_ranges
from megatrain.runtime.errors import ConfigError

__all__ = ["ModelConfig", "OptimizerConfig", "read_config_json", "SUPPORTED_ACTIVATIONS", "SUPPORTED_MODEL_TYPES",
           "SUPPORTED_ROPE_TYPES"]

_T = TypeVar("_T")


@dataclass(frozen=True)
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
    (``None``: every layer alike, sliding when ``sliding_window`` is set). ``rope_local_base_freq``: the RoPE base
    of the sliding layers, unscaled (``None``: theirs is the full layers'). ``query_pre_attn_scalar``: attention
    scores scaled by its ** -0.5 (``None``: head_dim's); ``final_logit_softcapping``: logits capped to
    c x tanh(logits / c) (``None``: not capped).
    ``num_experts`` > 0: the MLP is sparse (``megatrain.models.moe``): ``num_experts_per_tok`` experts of width
    ``moe_intermediate_size`` per token, top-k weights renormalised when ``norm_topk_prob``, and a shared expert
    of width ``shared_expert_intermediate_size`` when it is > 0; ``router_aux_loss_coef`` (None: none) the weight
    of the routers' load-balancing loss in the loss (transformers' ``output_router_logits``).
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
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    router_aux_loss_coef: float | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.o_proj_bias is None:
            object.__setattr__(self, "o_proj_bias", self.attention_bias)
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        object.__setattr__(self, "rms_norm_eps", float(self.rms_norm_eps))
        scaling = _field(hf_config.rope_scaling, self.rope_scaling, self.max_position_embeddings)
        object.__setattr__(self, "rope_scaling", None if scaling is None else _FrozenDict(scaling))
        self._validate_ranges()
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.pad_token_id is not None and not (0 <= self.pad_token_id < self.vocab_size):
            # Hugging Face treats an out-of-range pad id as absent for the embedding.
            object.__setattr__(self, "pad_token_id", None)

    def _check_types(self) -> None:
        """Every field of the right type (the one-line error names it), before any arithmetic on it."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        for name in ("num_key_value_heads", "head_dim", "pad_token_id", "sliding_window"):
            _field(hf_config.optional_integer, name, getattr(self, name))
        for name in ("rope_theta", "rms_norm_eps", "initializer_range"):
            _field(hf_config.number, name, getattr(self, name))
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias", "qk_norm", "norm_topk_prob"):
            _field(hf_config.boolean, name, getattr(self, name))
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name}={value!r} must be an integer >= 0")
        if self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size):
            raise ConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                              f"{self.num_experts} and moe_intermediate_size positive for a sparse MLP")
        if self.router_aux_loss_coef is not None and not self.num_experts:
            raise ConfigError(f"router_aux_loss_coef={self.router_aux_loss_coef!r} weighs the load-balancing loss of a "
                              "sparse MLP; set it to None for a dense model (num_experts=0)")
        if self.o_proj_bias is not None:
            _field(hf_config.boolean, "o_proj_bias", self.o_proj_bias)
        if self.layer_types is not None:
            types = _field(hf_config.layer_types, "layer_types", self.layer_types, self.num_hidden_layers)
            object.__setattr__(self, "layer_types", types)
        for name in ("rope_local_base_freq", "query_pre_attn_scalar", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not 0 < _field(hf_config.number, name, value) < float("inf"):
                raise ConfigError(f"{name}={value!r} must be a positive finite number, or None")
            object.__setattr__(self, name, None if value is None else float(value))
        if registry.find(self.model_type) is None:
            raise ConfigError(
                f"model_type={self.model_type!r} is not supported; supported: {', '.join(registry.model_types())}"
            )
        _field(hf_config.activation, "hidden_act", self.hidden_act)

    def _validate_ranges(self) -> None:
        """The one place for numeric range checks of the model fields (types are already checked)."""
        check_model_ranges(self)
        kv = self.num_key_value_heads
        if kv < 1:  # type: ignore[operator]
            raise ConfigError(f"num_key_value_heads={kv!r} must be a positive integer")
        if self.num_attention_heads % kv != 0:  # type: ignore[operator]
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={kv}; choose num_key_value_heads among the divisors of "
                f"{self.num_attention_heads}: {_divisors(self.num_attention_heads)}"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ConfigError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; set head_dim explicitly or choose num_attention_heads "
                    f"among {_divisors(self.hidden_size)}"
                )
        elif self.head_dim < 2 or self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim!r} must be an even integer >= 2 (rotary embeddings pair dimensions)")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta={self.rope_theta!r} must be a positive number")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps={self.rms_norm_eps!r} must be positive")

    # ---- derived sizes -------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim  # type: ignore[operator]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.rope_scaling is not None:
            d["rope_scaling"] = dict(self.rope_scaling)
        return d

    # ---- Hugging Face config.json --------------------------------------
    @classmethod
    def from_hf(cls, source: str | os.PathLike | Mapping[str, Any]) -> "ModelConfig":
        """Read a Hugging Face ``config.json`` (a path to it, its directory, or the parsed dict).

        The rules for each field are ``megatrain.models.hf_config``'s (transformers' for the family).
        """
        reader = hf_config.parse if isinstance(source, Mapping) else hf_config.read
        return cls(**_field(reader, source).fields())


def read_config_json(source: str | os.PathLike) -> dict[str, Any]:
    """The parsed JSON object of a ``config.json`` (a path to it, or its directory)."""
    return _field(hf_config.read_config_json, source)


def _field(read: Callable[..., _T], *args: Any) -> _T:
    """``read(*args)`` with the reader's one-line error raised as a ``ConfigError``."""
    try:
        return read(*args)
    except hf_config.HFConfigError as e:
        raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW hyper-parameters, as ``torch.optim.AdamW`` takes them.

    ``max_grad_norm=None`` means no clipping (and allows the eager optimizer).
    Weight decay applies to every parameter except those whose Hugging Face name
    contains one of the ``no_decay`` patterns (e.g. ``("norm", "bias")``).
    """

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    no_decay: tuple[str, ...] = field(default_factory=tuple)
    skip_nonfinite: bool = False  # a non-finite gradient skips the update (runtime/optim/cpu_adamw.py)
    # AdamW m and v kept as "fp32", or "bf16" with stochastic rounding (runtime/optim/stochastic_rounding.py)
    state_dtype: str = "fp32"

    def __post_init__(self) -> None:
        check_optimizer_ranges(self)
        if not (isinstance(self.lr, (int, float)) and self.lr >= 0):
            raise ConfigError(f"lr={self.lr!r} must be a number >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"betas={self.betas!r} must be two numbers in [0, 1), e.g. (0.9, 0.95)")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        if not self.eps > 0:
            raise ConfigError(f"eps={self.eps!r} must be positive, e.g. 1e-8")
        if not self.weight_decay >= 0:
            raise ConfigError(f"weight_decay={self.weight_decay!r} must be >= 0")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm={self.max_grad_norm!r} must be positive, or None for no clipping")
        if isinstance(self.no_decay, str):
            object.__setattr__(self, "no_decay", (self.no_decay,))
        object.__setattr__(self, "no_decay", tuple(self.no_decay))

    @property
    def clipping(self) -> bool:
        return self.max_grad_norm is not None

    def decays(self, hf_name: str) -> bool:
        return self.weight_decay > 0 and not any(p in hf_name for p in self.no_decay)


class _FrozenDict(dict):
    """A dict that refuses mutation, so a frozen config stays frozen (and hashes)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("ModelConfig.rope_scaling is read-only; build a new ModelConfig")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted((k, repr(v)) for k, v in self.items())))


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
