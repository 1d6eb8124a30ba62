"""Each rank's shard of every block: the shard layout of data-parallel runs.

[Note: shards]
With W ranks, block b (flat layout of n elements, templates.py) is cut into W
shards of ``s = ceil(n / W)`` elements rounded up to ``ALIGN_ELEMENTS``;
rank r owns elements ``[r*s, (r+1)*s)`` of the block's flat layout padded with
zeros to ``W*s``. So the W shards, concatenated in rank order, are the block's
flat layout (plus zero padding), which is what an all-gather into a slot
produces and what a reduce-scatter of the block's gradient cuts. Every rank
keeps its shards of every kind (fp32 master, m, v, grads, compute-dtype shadow)
in its own host store, which is built from the shard blocks below exactly as a
single process's store is built from the whole blocks: the store, the spill
files and AdamW need no other change. A shard block's layout lists, per
parameter that overlaps the shard, the overlapping piece as a 1-D entry (same
names, decay flag), so AdamW updates the weight-decay and no-decay pieces apart.

Memory per rank: 1/W of the host state, plus up to ALIGN_ELEMENTS x W padding
elements per block. On the device a slot holds a whole padded block (``W*s``).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatrain.plan.block_parameters import aligned

from megatrain.runtime.model.templates import Block, BlockLayout, ParamEntry


def shard_numel(numel: int, world_size: int) -> int:
    """Elements of one rank's shard of a block of ``numel`` elements (aligned; the last ones may be padding)."""
    return aligned(-(-numel // world_size))


def shard_layout(layout: BlockLayout, rank: int, world_size: int) -> BlockLayout:
    """The pieces of ``layout``'s parameters inside rank's shard, as 1-D entries at offsets within the shard."""
    s = shard_numel(layout.numel, world_size)
    lo, hi = rank * s, (rank + 1) * s
    entries = []
    for e in layout.entries:
        start, end = max(lo, e.offset), min(hi, e.offset + e.numel)
        if start < end:
            entries.append(ParamEntry(e.local_name, e.hf_name, (end - start,), start - lo, e.decay))
    return BlockLayout(tuple(entries), s)


@dataclass(frozen=True)
class Shards:
    """Rank ``rank``'s shard of every block of ``blocks`` among ``world_size`` ranks."""

    blocks: tuple[Block, ...]  # the shard blocks: same index and kind, the shard's layout
    full: tuple[Block, ...]  # the whole blocks
    rank: int
    world_size: int

    @classmethod
    def of(cls, blocks: tuple[Block, ...], rank: int, world_size: int) -> "Shards":
        assert 0 <= rank < world_size
        shard_blocks = tuple(Block(b.index, b.kind, b.layer, shard_layout(b.layout, rank, world_size)) for b in blocks)
        return cls(shard_blocks, tuple(blocks), rank, world_size)

    def numel(self, b: int) -> int:
        """Elements of each rank's shard of block b."""
        return self.blocks[b].layout.numel

    def padded(self, b: int) -> int:
        """Block b's flat layout padded to W shards: what a slot or a device gradient buffer holds of it."""
        return self.numel(b) * self.world_size

    def own(self, b: int) -> slice:
        """This rank's elements of block b's (padded) flat layout."""
        s = self.numel(b)
        return slice(self.rank * s, (self.rank + 1) * s)

    @property
    def slot_numel(self) -> int:
        """A device slot: the largest padded block."""
        return max(self.padded(b.index) for b in self.blocks)
