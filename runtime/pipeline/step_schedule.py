"""The load sequences of a training step and of evaluation: which block is resident when, in order.

[Note: load sequence]
Forward loads the embedding, each decoder layer, the head, and, with tied
embeddings, the embedding again: its table is the head's lm_head weight, so the
head computes while both are resident. Backward (training only) loads each
layer again in reverse; the embedding's backward needs no weights. A backward
load recomputes its layer from the activation checkpoints forward saved, so it
may be issued only after the last forward layer was released (``after``): by
then every checkpoint is written. Evaluation runs the forward part alone.
A layer streamed in parts ([Note: expert groups] in experts/expert_parts.py) is several loads of its block: forward
its dense part then each expert group; backward its dense part (the routing), each group, the dense part again.
The loader (weight_slots.py) runs a sequence through the slots; the executor
computes on each load while it is resident. ``update_order`` is the order in which
the step's blocks reach CPU AdamW, handed to the spill read-ahead as plain data.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import torch

from megatrain.runtime.model.templates import Block, BlockLayout, Templates
from megatrain.runtime.pipeline.experts.expert_parts import Part


class Load(NamedTuple):
    index: int  # position in the sequence: the loader's load number
    block: Block
    phase: str  # "fwd" or "bwd"
    layer: int = -1  # decoder layer number (its activation checkpoints); -1 for the embedding and the head
    after: int | None = None  # a load that must be released before this one is issued (its inputs)
    part: Part | None = None  # the part of the block loaded ([Note: expert groups]); None: the whole block

    @property
    def layout(self) -> BlockLayout:
        """The layout of what this load puts in its slot: the block's, or its part's."""
        return self.block.layout if self.part is None else self.part.layout

    @property
    def numel(self) -> int:
        return self.layout.numel


@dataclass(frozen=True)
class StepSchedule:
    embed: Load
    layers: tuple[Load, ...]  # forward, in order
    head_loads: tuple[Load, ...]  # resident together: the head, then (tied) the embedding again
    backward: tuple[Load, ...]  # layers in reverse; empty for evaluation
    lm_weight_name: str  # lm_head's weight, in the last of ``head_loads``

    @property
    def loads(self) -> tuple[Load, ...]:
        return (self.embed, *self.layers, *self.head_loads, *self.backward)

    @property
    def head(self) -> Load:
        return self.head_loads[0]

    @property
    def tied(self) -> bool:
        return len(self.head_loads) == 2

    def update_order(self, eager: bool) -> tuple[int, ...]:
        """The blocks in the order CPU AdamW updates them every step ([Note: optimizer modes] in cpu_adamw.py):
        eager, each as its gradients drain (the head, the layers in reverse, the embedding); deferred, all after
        backward in forward order. What the spill read-ahead reads the next step's chunks in (read_ahead.py)."""
        # a layer streamed in parts is one update, when its last part has drained: dict.fromkeys keeps it once
        if eager:
            return tuple(dict.fromkeys((self.head.block.index, *(load.block.index for load in self.backward),
                                        self.embed.block.index)))
        return tuple(dict.fromkeys((self.embed.block.index, *(load.block.index for load in self.layers),
                                    self.head.block.index)))

    def lm_weight(self, head_params: Sequence[dict[str, torch.Tensor]]) -> torch.Tensor:
        """lm_head's weight [vocab, hidden] among the views of ``head_loads``: the head's own or the embedding's."""
        return head_params[-1][self.lm_weight_name]


Parts = Mapping[int, Sequence[Part]]  # per layer block streamed in parts: the dense part, then the expert groups


def training_schedule(templates: Templates, parts: Parts | None = None) -> StepSchedule:
    """Forward, tied re-load, backward (see [Note: load sequence]); ``parts``: the layers streamed in parts."""
    return _schedule(templates, backward=True, parts=parts or {})


def evaluation_schedule(templates: Templates, parts: Parts | None = None) -> StepSchedule:
    """The forward part of a training step: what evaluation loads."""
    return _schedule(templates, backward=False, parts=parts or {})


def _schedule(templates: Templates, backward: bool, parts: Parts) -> StepSchedule:
    embed, head, layers = templates.embed, templates.head, templates.layers
    tied = templates.config.tie_word_embeddings
    fwd = [Load(0, embed, "fwd")]
    for b in layers:
        for part in parts.get(b.index, (None,)):
            fwd.append(Load(len(fwd), b, "fwd", _layer(b), part=part))
    head_loads = [Load(len(fwd), head, "fwd")]
    if tied:
        head_loads.append(Load(len(fwd) + 1, embed, "fwd"))
    first, last_forward_layer = len(fwd) + len(head_loads), fwd[-1].index
    bwd: list[Load] = []
    for b in reversed(layers):
        split = parts.get(b.index)  # the dense part, each group, the dense part again
        for part in (None,) if split is None else (*split, split[0]):
            bwd.append(Load(first + len(bwd), b, "bwd", _layer(b), after=last_forward_layer, part=part))
    return StepSchedule(fwd[0], tuple(fwd[1:]), tuple(head_loads), tuple(bwd) if backward else (),
                        "embed_tokens.weight" if tied else "lm_head.weight")


def _layer(block: Block) -> int:
    assert block.layer is not None, f"block {block.index} is not a decoder layer"
    return block.layer
