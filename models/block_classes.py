"""A family's torch blocks: its embedding, decoder layer and head classes, from the module its ``blocks`` names.

The torch half of the registry: the runtime asks here, the planner never does (the module it imports holds torch
modules). A blocks module defines ``EmbeddingBlock``, ``DecoderLayer`` and ``HeadBlock``, each built from a config
(``model_config.ModelConfig``) and registering its parameters in the family's table order.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from . import registry


@dataclass(frozen=True)
class BlockClasses:
    embedding: Callable[[Any], Any]
    layer: Callable[[Any], Any]
    head: Callable[[Any], Any]


def block_classes(model_type: str) -> BlockClasses:
    """The block classes of ``model_type``'s family."""
    module = importlib.import_module(registry.family(model_type).blocks)
    return BlockClasses(module.EmbeddingBlock, module.DecoderLayer, module.HeadBlock)
