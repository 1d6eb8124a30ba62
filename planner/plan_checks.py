"""A plan's errors and the checks its fields share: one line each, naming the field, the value and the fix.
Pure stdlib."""
from __future__ import annotations

from typing import Any

from megatrain.errors import MegatrainError


class PlanError(MegatrainError):
    """A Plan field is out of range, or a plan file cannot be read.

    The message is one line: the field, the value, and how to fix it.
    """


def at_least(field: str, value: Any, low: int, why: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise PlanError(f"{field}={value!r} must be an integer >= {low} ({why})")


def one_of(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise PlanError(f"{field}={value!r} must be one of {', '.join(repr(c) for c in choices)}")
