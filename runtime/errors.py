"""User-facing errors of the runtime.

Each carries a one-line message that names the field or argument, the value,
and the fix. Commands print the message, not a traceback. Internal invariants
use ``assert`` instead.
"""
from __future__ import annotations

from megatrain.planner.plan import PlanError


class MegatrainError(ValueError):
    """Base class: something the user can fix, explained in one line."""


class ConfigError(MegatrainError):
    """A model or optimizer configuration is invalid or unsupported."""


class InputError(MegatrainError):
    """A batch passed to the engine has the wrong shape, dtype or values."""


__all__ = ["MegatrainError", "ConfigError", "InputError", "PlanError"]
