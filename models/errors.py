"""The errors the model families raise: a config field a family cannot use, an attention kernel a device lacks.

Both derive from ``MegatrainError``; the planner (``hf_config``) and the runtime (``runtime/errors.py``) re-export
them unchanged. Pure stdlib.
"""
from __future__ import annotations

from megatrain.errors import MegatrainError


class HFConfigError(MegatrainError):
    """A config.json (or one of its fields) cannot be used. One line: the field, the value, the fix."""


class AttentionBackendError(MegatrainError):
    """Long-context attention needs a kernel this device or torch build does not offer."""


__all__ = ["HFConfigError", "AttentionBackendError"]
