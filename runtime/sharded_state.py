"""The model state of one rank of a data-parallel run: whole blocks in and out of a store of shards.

The rank's host store holds its shard of every block (shards.py, [Note: shards]). What reads or
writes whole blocks (state dicts, initialisation, Hugging Face files, checkpoints) goes through the
same ``ModelState`` interface: ``read_block`` gathers the block from every rank, ``edit_block`` gives
the whole block and keeps this rank's shard of it. Both are collectives: every rank calls them for the
same blocks in the same order (they do, running the same code). Peak extra RAM: one whole block.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from megatrain.planner.buffer_kinds import BufferKind

from .collectives import Collectives
from .host_store import HostStore
from .model_state import ModelState
from .templates import Templates


class ShardedModelState(ModelState):
    def __init__(self, templates: Templates, store: HostStore, settle: Callable[[], None],
                 collectives: Collectives) -> None:
        super().__init__(templates, store, settle)
        self.collectives = collectives
        self.shards = collectives.shards
        self.full_offsets: list[int] = []
        total = 0
        for block in templates.blocks:
            self.full_offsets.append(total)
            total += block.layout.numel
        self.full_numel = total

    @contextlib.contextmanager
    def edit_block(self, b: int) -> Iterator[torch.Tensor]:
        """Block b's whole fp32 master ([numel], a gathered copy) to change; on leaving, this rank's shard of
        it is stored (and rounded into the shadow). If the body raises, nothing is stored."""
        whole = self.read_block(BufferKind.MASTER, b)
        yield whole
        padded = torch.zeros(self.shards.padded(b), dtype=torch.float32)
        padded[:whole.numel()] = whole
        own = padded[self.shards.own(b)]
        self.store.write_block(BufferKind.MASTER, b, own)
        self.store.refresh_shadow(b, own)

    def read_block(self, kind: BufferKind, b: int) -> torch.Tensor:
        """Block b's whole fp32 ``kind`` ([numel]), gathered from every rank (a copy)."""
        return self.collectives.gather_host(b, self.store.read_block(kind, b))

    def read_shard(self, kind: BufferKind, b: int) -> torch.Tensor:
        """This rank's shard of block b's ``kind`` (a view of RAM or a copy of its spill file's block)."""
        return self.store.read_block(kind, b)

    def tensor_table(self) -> dict[str, dict[str, Any]]:
        return {e.hf_name: {"offset": self.full_offsets[b.index] + e.offset, "shape": list(e.shape)}
                for b in self.templates.blocks for e in b.layout.entries}
