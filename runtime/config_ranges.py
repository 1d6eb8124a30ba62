"""Range checks of every number and flag in OptimizerConfig, run first on construction (ModelConfig's are
``megatrain.models.model_config_checks``').

Each field has a type and a range; a value outside it (a string, None, NaN,
infinity, a negative learning rate, ``betas`` that are not two numbers in
[0, 1)) is refused with one line naming the field, the
value and what it must be. Non-finite numbers are the point: one NaN or
infinity in a hyper-parameter silently turns every weight into NaN. So are the
upper bounds of the optimizer's numbers (``LR_MAX``, ``WEIGHT_DECAY_MAX``,
``EPS_MAX``): far above any real run's, they refuse only values that overflow
the masters (``lr=1e308`` makes the first update infinite), as does a decoupled
weight decay ``lr x weight_decay >= 1``, which flips or zeroes every weight.
"""
from __future__ import annotations

import math
from typing import Any

from megatrain.runtime.errors import ConfigError


# Upper bounds no real AdamW run comes near (learning rates are ~1e-5..1e-2, weight decay ~0..0.1, eps ~1e-8).
LR_MAX = 1.0
WEIGHT_DECAY_MAX = 10.0
EPS_MAX = 1.0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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


def flag(name: str, value: Any, *, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        raise ConfigError(f"{name}={value!r} must be True or False{' (or None)' if optional else ''}")


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
