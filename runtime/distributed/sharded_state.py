"""The model state of one rank of a data-parallel run: whole blocks in and out of a store of shards.

The rank's host store holds its shard of every block (shards.py, [Note: shards]). What reads or
writes whole blocks (state dicts, initialisation, Hugging Face files, checkpoints) goes through the
same ``ModelState`` interface: ``read_block`` gathers the block from every rank, ``edit_block`` gives
the whole block and keeps this rank's shard of it. Both are collectives: every rank calls them for the
same blocks in the same order (they do, running the same code). Peak extra RAM: one whole block.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from megatrain.plan.buffer_kinds import BufferKind

from megatrain.runtime.distributed.collectives import Collectives
from megatrain.runtime.errors import CheckpointError
from megatrain.runtime.state.host_store import HostStore
from megatrain.runtime.state.model_state import ModelState
from megatrain.runtime.model.templates import Templates

T = TypeVar("T")


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
        self._leading = False  # rank 0 inside on_first_rank: its reads are announced to the serving ranks

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
        """Block b's whole fp32 ``kind`` ([numel]), gathered from every rank (a copy). Inside ``on_first_rank``
        rank 0 alone calls it, and tells the serving ranks which block to gather."""
        if self._leading:
            dist.broadcast_object_list([kind.value, b], src=0)
        return self.collectives.gather_host(b, self.store.read_block(kind, b))

    def on_first_rank(self, work: Callable[[], T]) -> T | None:
        """Every rank calls it; rank 0 runs ``work`` (e.g. writing a Hugging Face directory), whose whole-block reads
        the other ranks serve meanwhile, in whatever order it makes them. An error on rank 0 is raised on every
        rank (one line). Rank 0 returns what ``work`` returns; the others None."""
        if self.shards.rank != 0:
            self.settle()
            while True:
                message: list = [None, None]
                dist.broadcast_object_list(message, src=0)
                kind, b = message
                if kind is None:
                    if b is not None:
                        raise CheckpointError(b)
                    return None
                self.read_block(BufferKind(kind), b)
        self._leading = True
        try:
            result = work()
        except BaseException as e:
            self._leading = False
            dist.broadcast_object_list([None, _one_line(e)], src=0)
            raise
        self._leading = False
        dist.broadcast_object_list([None, None], src=0)
        return result

    def read_shard(self, kind: BufferKind, b: int) -> torch.Tensor:
        """This rank's shard of block b's ``kind`` (a view of RAM or a copy of its spill file's block)."""
        return self.store.read_block(kind, b)

    def block_table(self) -> list[dict[str, int]]:
        return [{"offset": self.full_offsets[b.index], "numel": b.layout.numel} for b in self.templates.blocks]

    def tensor_table(self) -> dict[str, dict[str, Any]]:
        return {e.hf_name: {"offset": self.full_offsets[b.index] + e.offset, "shape": list(e.shape)}
                for b in self.templates.blocks for e in b.layout.entries}


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
