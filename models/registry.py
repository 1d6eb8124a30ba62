"""The families megatrain supports, by ``model_type``: one line per family. Pure stdlib.

``family(model_type)`` is what every other part asks; ``register`` adds a family at run time (a test's toy
family, a user's own) and ``unregister`` takes it away again.
"""
from __future__ import annotations

from .errors import HFConfigError
from .family import Family
from .gemma3_text.family import FAMILY as GEMMA3_TEXT
from .gpt_oss.family import FAMILY as GPT_OSS
from .llama.family import FAMILY as LLAMA
from .mistral.family import FAMILY as MISTRAL
from .mixtral.family import FAMILY as MIXTRAL
from .olmo2.family import FAMILY as OLMO2
from .phi3.family import FAMILY as PHI3
from .qwen2.family import FAMILY as QWEN2
from .qwen3.family import FAMILY as QWEN3
from .qwen2_moe.family import FAMILY as QWEN2_MOE
from .qwen3_moe.family import FAMILY as QWEN3_MOE

# A config.json without model_type is read as this family's, as transformers' LlamaConfig would.
DEFAULT_MODEL_TYPE = LLAMA.model_type

_FAMILIES: dict[str, Family] = {f.model_type: f for f in (LLAMA, QWEN2, QWEN3, MISTRAL, PHI3, OLMO2, MIXTRAL, QWEN3_MOE,
                                                          QWEN2_MOE, GEMMA3_TEXT, GPT_OSS)}
# The built-in model types, in the registry's order.
BUILTIN_MODEL_TYPES = tuple(_FAMILIES)


def model_types() -> tuple[str, ...]:
    """Every registered ``model_type``, built-in ones first."""
    return tuple(_FAMILIES)


def find(model_type: object) -> Family | None:
    return _FAMILIES.get(model_type) if isinstance(model_type, str) else None


def family(model_type: object) -> Family:
    """The family of ``model_type``, or one line naming the supported ones."""
    found = find(model_type)
    if found is None:
        raise HFConfigError(f"model_type={model_type!r} is not supported; supported: {', '.join(_FAMILIES)}")
    return found


def families() -> tuple[Family, ...]:
    return tuple(_FAMILIES.values())


def register(f: Family) -> None:
    """Add a family; its ``model_type`` must be new."""
    if f.model_type in _FAMILIES:
        raise HFConfigError(f"model_type={f.model_type!r} is already registered; choose another name")
    _FAMILIES[f.model_type] = f


def unregister(model_type: str) -> None:
    """Remove a family added with ``register`` (built-in families stay)."""
    if model_type in BUILTIN_MODEL_TYPES:
        raise HFConfigError(f"model_type={model_type!r} is built in and cannot be unregistered")
    _FAMILIES.pop(model_type, None)
