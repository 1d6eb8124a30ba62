"""The errors the model families raise: a configuration a family cannot use, an attention kernel a device lacks.

Both derive from ``MegatrainError``; the runtime (``runtime/errors.py``) re-exports them unchanged. Pure stdlib.
"""
from __future__ import annotations

from megatrain.errors import MegatrainError


class ConfigError(MegatrainError):
    """A model or optimizer configuration (a config.json, one of its fields, a constructor argument) is invalid or
    unsupported. One line: the field, the value, the fix."""


# The config.json reader's name for it (``hf_config``, the families' ``read``): one class, so a field refused while
# reading and one refused by ``ModelConfig``'s checks are the same error.
HFConfigError = ConfigError


class AttentionBackendError(MegatrainError):
    """Long-context attention needs a kernel this device or torch build does not offer."""


__all__ = ["ConfigError", "HFConfigError", "AttentionBackendError"]
