"""Model and optimizer configuration: frozen, validated, Hugging Face field names."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .config_ranges import check_model_ranges, check_optimizer_ranges
from .errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder. Field names follow Hugging Face ``config.json``.

    ``head_dim=None`` means ``hidden_size // num_attention_heads``. ``rope_scaling``
    is ``None`` (plain RoPE) or a dict with ``rope_type`` in ``linear`` / ``llama3``
    and that type's parameters. ``qk_norm`` is Qwen3's RMSNorm on queries and keys.
    ``attention_bias`` puts a bias on q, k and v; ``o_proj_bias`` (default: the same
    as ``attention_bias``) on the output projection; Qwen2 has the first and not the
    second.
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
    initializer_range: float = 0.02
    model_type: str = "llama"

    def __post_init__(self) -> None:
        check_model_ranges(self)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        kv = self.num_key_value_heads
        if not isinstance(kv, int) or kv < 1:
            raise ConfigError(f"num_key_value_heads={kv!r} must be a positive integer")
        if self.num_attention_heads % kv != 0:
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
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim!r} must be an even integer >= 2 (rotary embeddings pair dimensions)")
        if self.o_proj_bias is None:
            object.__setattr__(self, "o_proj_bias", self.attention_bias)
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0):
            raise ConfigError(f"rope_theta={self.rope_theta!r} must be a positive number")
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        if not (self.rms_norm_eps > 0):
            raise ConfigError(f"rms_norm_eps={self.rms_norm_eps!r} must be positive")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type={self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.pad_token_id is not None and not (0 <= self.pad_token_id < self.vocab_size):
            # Hugging Face treats an out-of-range pad id as absent for the embedding.
            object.__setattr__(self, "pad_token_id", None)
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ConfigError(
                    f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            scaling["rope_type"] = rope_type
            scaling.pop("type", None)
            if rope_type == "default":
                object.__setattr__(self, "rope_scaling", None)
            else:
                needed = ("factor",) if rope_type == "linear" else (
                    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                missing = [k for k in needed if k not in scaling]
                if missing:
                    raise ConfigError(f"rope_scaling of type {rope_type!r} lacks {', '.join(missing)}; add them to the config")
                object.__setattr__(self, "rope_scaling", _FrozenDict(scaling))

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
        """Read a Hugging Face ``config.json`` (a path to it, its directory, or the parsed dict)."""
        data = _read_config_json(source) if not isinstance(source, Mapping) else dict(source)
        model_type = data.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type={model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in data]
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)}; is it a causal language model config?")
        rope_theta, rope_scaling = _read_rope(data)
        attention_bias = bool(data.get("attention_bias", model_type == "qwen2"))
        o_proj_bias = False if model_type == "qwen2" else attention_bias
        sliding_window = data.get("sliding_window")
        if model_type == "qwen2" and not data.get("use_sliding_window", False):
            sliding_window = None
        return cls(
            vocab_size=data["vocab_size"],
            hidden_size=data["hidden_size"],
            intermediate_size=data["intermediate_size"],
            num_hidden_layers=data["num_hidden_layers"],
            num_attention_heads=data["num_attention_heads"],
            num_key_value_heads=data.get("num_key_value_heads"),
            head_dim=data.get("head_dim"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=data.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=o_proj_bias,
            mlp_bias=bool(data.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            max_position_embeddings=data.get("max_position_embeddings", 4096),
            pad_token_id=data.get("pad_token_id"),
            sliding_window=sliding_window,
            initializer_range=data.get("initializer_range", 0.02),
            model_type=model_type,
        )


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
    skip_nonfinite: bool = False  # a non-finite gradient skips the update (runtime/cpu_adamw.py)

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


def _read_config_json(source: str | os.PathLike) -> dict[str, Any]:
    path = os.fspath(source)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {path}; pass a Hugging Face model directory or its config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); fix or re-download it") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a {type(data).__name__}, not a config object")
    return data


def _read_rope(data: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Both spellings: ``rope_theta`` + ``rope_scaling`` (older) and ``rope_parameters`` (transformers 5)."""
    params = data.get("rope_parameters")
    if isinstance(params, Mapping) and params:
        params = dict(params)
        theta = params.pop("rope_theta", data.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        return float(theta), (None if rope_type == "default" else params)
    scaling = data.get("rope_scaling")
    return float(data.get("rope_theta", 10000.0)), (dict(scaling) if scaling else None)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
