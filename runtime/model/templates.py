"""Stateless layer templates and the static layout of each block's flat buffer.

[Note: stateless templates]
One ``nn.Module`` per block structure (embedding, decoder layer, head) is built
once on the meta device and holds no weights. Every block owns one flat buffer
(in the host store, and in a device slot while resident); a static layout table
maps each parameter name to (offset, shape) inside it. Running a block binds
views of the slot's flat buffer into the template (as ``torch.func.functional_call``
does) and calls it: no per-layer copy into module parameters, no
autograd graph across blocks, no persistent per-layer modules on the device.

Binding writes each view into its owning submodule's parameter table, found once per template
(``TemplateBinding``), and puts the meta parameters back after; ``functional_call`` walks the module tree again on
every call, which a tiled layer's backward pays thousands of times a step in one-token tiles. ``bound`` keeps a
block's views bound across many calls: a layer's tiled backward binds once per visit (``sequence_tiles.py``).
A compiled layer (``compiled_layers.py``) binds inside the compiled function with ``functional_call``, which
``torch.compile`` traces.

Decoder layers of different types (``layer_types.py``: full or sliding attention, each type with its own window
and RoPE) have one template per type; each layer ``Block`` names its type and ``run`` picks its template.

The templates are the model family's blocks and the layout its parameter table
(``megatrain.models``, asked through ``megatrain.plan.block_parameters``, the one
the planner sizes blocks from), which is the templates' registration order (that
of Hugging Face; checked when the templates are built), each offset aligned to
``block_parameters.ALIGN_ELEMENTS`` elements; padding stays zero. Hugging Face
names are the family's too.
"""
from __future__ import annotations

import contextlib
import enum
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from megatrain.models import registry
from megatrain.models.block_classes import block_classes
from megatrain.plan import block_parameters
from megatrain.plan.block_parameters import Param

from megatrain.runtime.config import ModelConfig
from megatrain.runtime.model.layer_types import distinct_layer_types, layer_config, layer_type


class BlockKind(enum.Enum):
    EMBED = block_parameters.EMBED
    LAYER = block_parameters.LAYER
    HEAD = block_parameters.HEAD


@dataclass(frozen=True)
class ParamEntry:
    local_name: str  # name inside the block's template, e.g. "self_attn.q_proj.weight"
    hf_name: str  # Hugging Face state-dict name, e.g. "model.layers.3.self_attn.q_proj.weight"
    shape: tuple[int, ...]
    offset: int  # elements from the start of the block's flat buffer
    decay: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class BlockLayout:
    entries: tuple[ParamEntry, ...]
    numel: int  # padded length of the flat buffer

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` ([>= numel], any dtype) under the template's local names."""
        return {e.local_name: flat[e.offset:e.offset + e.numel].view(e.shape) for e in self.entries}

    def view_list(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[e.offset:e.offset + e.numel].view(e.shape) for e in self.entries]

    def range_views(self, flats: Sequence[torch.Tensor], lo: int, n: int
                    ) -> tuple[list["ParamEntry"], list[list[torch.Tensor]]]:
        """The entries overlapping elements [lo, lo + n) of the block, and for each of ``flats`` (each
        holding just those n elements) the 1-D views of those entries' parts, in entry order."""
        hit = [e for e in self.entries if e.offset < lo + n and e.offset + e.numel > lo]
        spans = [(max(e.offset, lo) - lo, min(e.offset + e.numel, lo + n) - lo) for e in hit]
        return hit, [[flat[a:z] for a, z in spans] for flat in flats]


@dataclass(frozen=True)
class Block:
    index: int  # position in the model's block list (embedding first, head last)
    kind: BlockKind
    layer: int | None  # decoder layer number, for LAYER blocks
    layout: BlockLayout
    layer_type: str | None = None  # a LAYER block's type (layer_types.py); None: every layer alike

    @property
    def label(self) -> str:
        return f"layer{self.layer}" if self.kind is BlockKind.LAYER else self.kind.value


class TemplateBinding:
    """Where each parameter of a template lives (its owning submodule and attribute), found once: binding a
    block's views is then one write per parameter, with ``functional_call``'s strict check of the names."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.places: dict[str, tuple[nn.Module, str]] = {}
        for name, _ in module.named_parameters():
            owner, _, attr = name.rpartition(".")
            self.places[name] = (module.get_submodule(owner), attr)

    @contextlib.contextmanager
    def bound(self, params: dict[str, torch.Tensor]) -> Iterator[nn.Module]:
        """The template with ``params`` (every parameter's tensor, by local name) in place of its meta parameters
        until the ``with`` ends (nested bindings restore in turn)."""
        assert params.keys() == self.places.keys(), (type(self.module).__name__, "missing",
                                                     sorted(self.places.keys() - params.keys()), "unexpected",
                                                     sorted(params.keys() - self.places.keys()))
        originals = [(owner, attr, owner._parameters[attr]) for owner, attr in self.places.values()]
        try:
            for name, (owner, attr) in self.places.items():
                owner._parameters[attr] = params[name]
            yield self.module
        finally:
            for owner, attr, original in originals:
                owner._parameters[attr] = original


def _align(n: int) -> int:
    return block_parameters.aligned(n)


def parameter_table(config: ModelConfig, kind: BlockKind) -> tuple[Param, ...]:
    """The parameters of a block of ``kind``, in layout order, from the family's one table."""
    return block_parameters.block_table(config.to_dict(), kind.value)


class Templates:
    """The meta-device template of each block kind (of decoder layers, one per layer type), and the model's block
    list."""

    def __init__(self, config: ModelConfig, decays: Callable[[str], bool]) -> None:
        self.config = config
        self.hf_name = registry.family(config.model_type).hf_name
        classes = block_classes(config.model_type)
        with torch.device("meta"):
            self.layer_modules: dict[str | None, nn.Module] = {
                t: classes.layer(layer_config(config, t)) for t in distinct_layer_types(config)}
            self.modules: dict[BlockKind, nn.Module] = {
                BlockKind.EMBED: classes.embedding(config),
                BlockKind.LAYER: next(iter(self.layer_modules.values())),  # the first layer's type
                BlockKind.HEAD: classes.head(config),
            }
        self.tables = {kind: parameter_table(config, kind) for kind in BlockKind}
        self.bindings = {module: TemplateBinding(module)
                         for module in (*self.modules.values(), *self.layer_modules.values())}
        for kind, module in [*self.modules.items(), *((BlockKind.LAYER, m) for m in self.layer_modules.values())]:
            registered = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
            assert registered == [(p.name, p.shape) for p in self.tables[kind]], (kind, registered)
        blocks = [self._block(0, BlockKind.EMBED, None, decays)]
        for i in range(config.num_hidden_layers):
            blocks.append(self._block(len(blocks), BlockKind.LAYER, i, decays))
        blocks.append(self._block(len(blocks), BlockKind.HEAD, None, decays))
        self.blocks: tuple[Block, ...] = tuple(blocks)

    def _block(self, index: int, kind: BlockKind, layer: int | None, decays: Callable[[str], bool]) -> Block:
        entries, offset = [], 0
        for p in self.tables[kind]:
            hf_name = self.hf_name(kind.value, layer, p.name)
            entry = ParamEntry(p.name, hf_name, p.shape, offset, decays(hf_name))
            entries.append(entry)
            offset = _align(offset + entry.numel)
        kind_of_layer = None if layer is None else layer_type(self.config, layer)
        return Block(index, kind, layer, BlockLayout(tuple(entries), offset), kind_of_layer)

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

    def embedding_backward(self, dy: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding table's gradient [vocab, hidden] (dy's dtype) for dy [b, S, hidden], the gradient of its
        output at input_ids [b, S]: a scatter-add of dy into the rows used (times the family's output scale,
        Gemma 3's scaled embeddings), the padding row left out; no weights needed."""
        scale = getattr(self.modules[BlockKind.EMBED], "output_scale", None)
        rows = dy if scale is None else dy * scale(dy.dtype)
        pad = -1 if self.config.pad_token_id is None else self.config.pad_token_id
        return torch.ops.aten.embedding_dense_backward(rows, input_ids, self.config.vocab_size, pad, False)

    def module(self, block: BlockKind | Block) -> nn.Module:
        """The template of ``block`` (a decoder layer's: its type's). A kind alone names the embedding's, the head's,
        or the layers' when they are all alike."""
        if isinstance(block, Block):
            return self.layer_modules[block.layer_type] if block.kind is BlockKind.LAYER else self.modules[block.kind]
        assert block is not BlockKind.LAYER or len(self.layer_modules) == 1, "a layer of which type?"
        return self.modules[block]

    def bound(self, block: BlockKind | Block, params: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager[
            nn.Module]:
        """The template of ``block`` (``module``) with ``params`` (views of a slot) bound until the ``with`` ends:
        for many calls of one block (a tiled backward's), each then a plain call of the module."""
        return self.bindings[self.module(block)].bound(params)

    def run(self, block: BlockKind | Block, params: dict[str, torch.Tensor], *args: object) -> torch.Tensor:
        """Run the template of ``block`` (``module``) with ``params`` bound (views of a slot)."""
        with self.bound(block, params) as module:
            return module(*args)
