"""Each block's parameters in order, asked of the model's family: the runtime's layouts and the planner's sizes.

The tables themselves are the families' (``megatrain.models``: names, shapes, order, Hugging Face names); this
module picks the family by ``model_type`` and fixes the flat layout both sides share: each parameter's offset
in a block's flat buffer is aligned to ``ALIGN_ELEMENTS`` elements.

Pure stdlib.
"""
from __future__ import annotations

from typing import Any, Mapping

from megatrain.models import registry
from megatrain.models.parameters import EMBED, HEAD, LAYER, Param

__all__ = ["ALIGN_ELEMENTS", "Param", "aligned", "block_table", "EMBED", "LAYER", "HEAD"]

# Every parameter's offset inside a block's flat buffer is a multiple of this many elements
# (256 B in fp32, 128 B in bf16).
ALIGN_ELEMENTS = 64


def aligned(numel: int) -> int:
    """Elements a parameter of ``numel`` elements occupies in a block's flat buffer."""
    return -(-numel // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


def block_table(dims: Mapping[str, Any], kind: str) -> tuple[Param, ...]:
    """The parameters of a block of ``kind`` (``EMBED``, ``LAYER``, ``HEAD``), in layout order, for the model whose
    config.json fields ``dims`` holds (its ``model_type`` picks the family)."""
    return registry.family(dims["model_type"]).parameters(dims, kind)
