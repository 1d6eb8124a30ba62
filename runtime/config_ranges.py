"""Range checks of every number and flag in ModelConfig and OptimizerConfig, run first on construction.

Each field has a type and a range; a value outside it (a string, None, NaN,
infinity, a negative learning rate, ``betas`` that are not two numbers in
[0, 1), a zero sliding window) is refused with one line naming the field, the
value and what it must be. Non-finite numbers are the point: one NaN or
infinity in a hyper-parameter silently turns every weight into NaN. So are the
upper bounds of the optimizer's numbers (``LR_MAX``, ``WEIGHT_DECAY_MAX``,
``EPS_MAX``): far above any real run's, they refuse only values that overflow
the masters (``lr=1e308`` makes the first update infinite), as does a decoupled
weight decay ``lr x weight_decay >= 1``, which flips or zeroes every weight.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from megatrain.models import registry
from megatrain.runtime.errors import ConfigError


# Upper bounds no real AdamW run comes near (learning rates are ~1e-5..1e-2, weight decay ~0..0.1, eps ~1e-8).
LR_MAX = 1.0
WEIGHT_DECAY_MAX = 10.0
EPS_MAX = 1.0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def number(name: str, value: Any, low: float, *, strict: bool, hint: str = "", high: float | None = None) -> None:
    """A finite int or float, > low (strict) or >= low, and <= high when given."""
    if not _is_number(value) or (value <= low if strict else value < low) or (high is not None and value > high):
        bound = f"> {low:g}" if strict else f">= {low:g}"
        top = f" and <= {high:g} (no real run uses more)" if high is not None else ""
        raise ConfigError(f"{name}={value!r} must be a finite number {bound}{top}{hint}")


def decay_product(lr: float, weight_decay: float) -> str | None:
    """Why ``lr`` and ``weight_decay`` together overflow or flip the weights (None: they do not). Decoupled
    weight decay multiplies each weight by ``1 - lr x weight_decay`` every step: at 1 or more it zeroes or
    flips them."""
    if lr * weight_decay >= 1:
        return (f"lr={lr!r} x weight_decay={weight_decay!r} = {lr * weight_decay:g} must be < 1 (each step scales "
                f"every weight by 1 - lr x weight_decay); lower one of them, e.g. lr 3e-4 and weight_decay 0.1")
    return None


def integer(name: str, value: Any, low: int, *, optional: bool = False, hint: str = "") -> None:
    if optional and value is None:
        return
    if not _is_int(value) or value < low:
        raise ConfigError(f"{name}={value!r} must be an integer >= {low}{' or None' if optional else ''}{hint}")


def flag(name: str, value: Any, *, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        raise ConfigError(f"{name}={value!r} must be True or False{' (or None)' if optional else ''}")


def check_model_ranges(c: Any) -> None:
    """ModelConfig's fields: types and ranges (the structural checks follow in ModelConfig itself)."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "max_position_embeddings"):
        integer(name, getattr(c, name), 1)
    integer("num_key_value_heads", c.num_key_value_heads, 1, optional=True)
    integer("head_dim", c.head_dim, 2, optional=True)
    integer("sliding_window", c.sliding_window, 1, optional=True, hint=" (None: full attention)")
    if c.pad_token_id is not None and not _is_int(c.pad_token_id):
        raise ConfigError(f"pad_token_id={c.pad_token_id!r} must be an integer token id or None")
    number("rope_theta", c.rope_theta, 0, strict=True, hint=", e.g. 10000.0")
    number("rms_norm_eps", c.rms_norm_eps, 0, strict=True, hint=", e.g. 1e-6")
    number("initializer_range", c.initializer_range, 0, strict=False, hint=", e.g. 0.02")
    for name in ("tie_word_embeddings", "attention_bias", "mlp_bias", "qk_norm"):
        flag(name, getattr(c, name))
    if c.router_aux_loss_coef is not None:
        number("router_aux_loss_coef", c.router_aux_loss_coef, 0, strict=False, hint=" or None (no aux loss)")
    flag("o_proj_bias", c.o_proj_bias, optional=True)
    if not isinstance(c.model_type, str):
        raise ConfigError(f"model_type={c.model_type!r} must be a string such as {registry.DEFAULT_MODEL_TYPE!r}")
    scaling = c.rope_scaling
    if scaling is None:
        return
    if not isinstance(scaling, Mapping):
        raise ConfigError(f"rope_scaling={scaling!r} must be None or a dict such as "
                          "{'rope_type': 'linear', 'factor': 2.0}")
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key in scaling:
            number(f"rope_scaling[{key!r}]", scaling[key], 0, strict=True)
    if "original_max_position_embeddings" in scaling:
        integer("rope_scaling['original_max_position_embeddings']", scaling["original_max_position_embeddings"], 1)
    low, high = scaling.get("low_freq_factor"), scaling.get("high_freq_factor")
    if low is not None and high is not None and not high > low:
        raise ConfigError(f"rope_scaling has high_freq_factor={high!r} <= low_freq_factor={low!r}; "
                          "llama3 scaling needs high > low (e.g. 4.0 and 1.0)")


def check_optimizer_ranges(c: Any) -> None:
    """OptimizerConfig's fields: finite numbers in range, ``betas`` two numbers in [0, 1)."""
    number("lr", c.lr, 0, strict=False, hint=", e.g. 3e-4", high=LR_MAX)
    betas = c.betas
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_is_number(b) and 0 <= b < 1 for b in betas)):
        raise ConfigError(f"betas={betas!r} must be two finite numbers in [0, 1), e.g. (0.9, 0.95)")
    number("eps", c.eps, 0, strict=True, hint=", e.g. 1e-8", high=EPS_MAX)
    number("weight_decay", c.weight_decay, 0, strict=False, hint=", e.g. 0.01 (0: none)", high=WEIGHT_DECAY_MAX)
    product = decay_product(c.lr, c.weight_decay)
    if product:
        raise ConfigError(product)
    if c.max_grad_norm is not None:
        number("max_grad_norm", c.max_grad_norm, 0, strict=True, hint=", or None for no clipping")
    flag("skip_nonfinite", c.skip_nonfinite)
    if c.state_dtype not in ("fp32", "bf16"):
        raise ConfigError(f"state_dtype={c.state_dtype!r} must be 'fp32' (exact) or 'bf16' (8 instead of 12 bytes "
                          "of host state per parameter)")
    no_decay = c.no_decay
    if not isinstance(no_decay, str) and not (isinstance(no_decay, (tuple, list)) and
                                               all(isinstance(p, str) for p in no_decay)):
        raise ConfigError(f"no_decay={no_decay!r} must be a tuple of name patterns, e.g. ('norm', 'bias')")
