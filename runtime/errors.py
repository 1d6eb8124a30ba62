"""User-facing errors of the runtime.

Each carries a one-line message that names the field or argument, the value,
and the fix. Commands print the message, not a traceback. Internal invariants
use ``assert`` instead. Every one derives from ``MegatrainError`` (defined in
``megatrain/errors.py``, shared with the planner, re-exported here unchanged).
"""
from __future__ import annotations

from megatrain.errors import MegatrainError
from megatrain.models.errors import AttentionBackendError, ConfigError
from megatrain.plan.plan import PlanError


class InputError(MegatrainError):
    """A batch passed to the engine has the wrong shape, dtype or values."""


class NonFiniteError(MegatrainError):
    """Weights hold NaN or infinity: refused where they are read (a model's files) or written (an export)."""


class CheckpointError(MegatrainError):
    """A checkpoint or export could not be written (disk full, permissions); the previous one is untouched."""


class ClosedError(MegatrainError):
    """The engine was closed; build or load a new one."""


__all__ = ["MegatrainError", "ConfigError", "InputError", "NonFiniteError", "CheckpointError", "ClosedError",
           "PlanError", "AttentionBackendError"]
