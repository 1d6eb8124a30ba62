"""Stateless layer templates and the static layout of each block's flat buffer.

[Note: stateless templates]
One ``nn.Module`` per block structure (embedding, decoder layer, head) is built
once on the meta device and holds no weights. Every block owns one flat buffer
(in the host store, and in a device slot while resident); a static layout table
maps each parameter name to (offset, shape) inside it. Running a block binds
views of the slot's flat buffer into the template with
``torch.func.functional_call``: no per-layer copy into module parameters, no
autograd graph across blocks, no persistent per-layer modules on the device.

Layout order: the template's registration order (that of Hugging Face), each
offset aligned to ``ALIGN`` elements; padding stays zero.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call

from .blocks import DecoderLayer, EmbeddingBlock, HeadBlock
from .config import ModelConfig

ALIGN = 64  # elements: 256 B in fp32, 128 B in bf16


class BlockKind(enum.Enum):
    EMBED = "embed"
    LAYER = "layer"
    HEAD = "head"


@dataclass(frozen=True)
class ParamEntry:
    local_name: str  # name inside the block's template, e.g. "self_attn.q_proj.weight"
    hf_name: str  # Hugging Face state-dict name, e.g. "model.layers.3.self_attn.q_proj.weight"
    shape: tuple[int, ...]
    offset: int  # elements from the start of the block's flat buffer
    decay: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class BlockLayout:
    entries: tuple[ParamEntry, ...]
    numel: int  # padded length of the flat buffer

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` ([>= numel], any dtype) under the template's local names."""
        return {e.local_name: flat[e.offset:e.offset + e.numel].view(e.shape) for e in self.entries}

    def view_list(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[e.offset:e.offset + e.numel].view(e.shape) for e in self.entries]


@dataclass(frozen=True)
class Block:
    index: int  # position in the model's block list (embedding first, head last)
    kind: BlockKind
    layer: int | None  # decoder layer number, for LAYER blocks
    layout: BlockLayout

    @property
    def label(self) -> str:
        return f"layer{self.layer}" if self.kind is BlockKind.LAYER else self.kind.value


def _hf_prefix(kind: BlockKind, layer: int | None, local_name: str) -> str:
    if kind is BlockKind.EMBED:
        return "model."
    if kind is BlockKind.LAYER:
        return f"model.layers.{layer}."
    return "" if local_name.startswith("lm_head.") else "model."


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Templates:
    """The meta-device template of each block kind, and the model's block list."""

    def __init__(self, config: ModelConfig, decays: Callable[[str], bool]) -> None:
        self.config = config
        with torch.device("meta"):
            self.modules: dict[BlockKind, nn.Module] = {
                BlockKind.EMBED: EmbeddingBlock(config),
                BlockKind.LAYER: DecoderLayer(config),
                BlockKind.HEAD: HeadBlock(config),
            }
        blocks = [self._block(0, BlockKind.EMBED, None, decays)]
        for i in range(config.num_hidden_layers):
            blocks.append(self._block(len(blocks), BlockKind.LAYER, i, decays))
        blocks.append(self._block(len(blocks), BlockKind.HEAD, None, decays))
        self.blocks: tuple[Block, ...] = tuple(blocks)

    def _block(self, index: int, kind: BlockKind, layer: int | None, decays: Callable[[str], bool]) -> Block:
        entries, offset = [], 0
        for name, p in self.modules[kind].named_parameters():
            hf_name = _hf_prefix(kind, layer, name) + name
            entry = ParamEntry(name, hf_name, tuple(p.shape), offset, decays(hf_name))
            entries.append(entry)
            offset = _align(offset + entry.numel)
        return Block(index, kind, layer, BlockLayout(tuple(entries), offset))

    @property
    def embed(self) -> Block:
        return self.blocks[0]

    @property
    def head(self) -> Block:
        return self.blocks[-1]

    @property
    def layers(self) -> tuple[Block, ...]:
        return self.blocks[1:-1]

    def hf_parameter_order(self) -> list[str]:
        """Hugging Face names in ``model.parameters()`` order (tied lm_head counted once, as torch does)."""
        return [e.hf_name for block in self.blocks for e in block.layout.entries]

    def run(self, kind: BlockKind, params: dict[str, torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
        """Run the template of ``kind`` with ``params`` bound (views of a slot)."""
        return functional_call(self.modules[kind], params, args, strict=True)
