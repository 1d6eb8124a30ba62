"""Which blocks of which kinds a plan keeps on disk: their sizes, for the memory and cost models, and the order in
which the search moves state from RAM to disk.

A plan's placement (``buffer_kinds.placement``) says, per kind (master, m, v, grads), which blocks live in
spill files; the blocks are the runtime's (0 the embedding, 1..L the layers, L + 1 the head). For a model
shape this module gives, per kind, the elements on disk (``Ns_k``) and the spill file's bytes (``F_k``: each
spilled block x the kind's element bytes s_k, rounded up to 4 KiB; s_k is 4, or 2 for m and v in bf16 AdamW
state), and which kinds of each block spill (what a block's AdamW reads and writes).

[Note: fill order]
The search fills RAM first and puts the rest on disk, in steps of one block: level 0 spills nothing; levels
1..nb spill AdamW m and v of one more block each; the next nb levels the fp32 master of one more block each;
the last nb levels (deferred mode only: eager mode keeps no gradient arena) the gradients of one more block
each. Within a kind, blocks go to disk from the last one backward: in deferred mode AdamW updates the blocks
in forward order while the next step's forward waits for each, so the blocks it updates last (whose disk
reads have the most time to run ahead) are the ones whose update is slowed by the disk. m and v come first
(8 bytes/param, 4 in bf16 state, touched only by AdamW), then the master (in fp32 also read by every load),
and gradients last (written in backward and read back: the most disk traffic per byte freed). The level that
spills every block of m and v is the plan "optimizer", and the last level the plan "all".

Pure stdlib.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from megatrain.plan.buffer_kinds import BufferKind, element_bytes, placement, spill_block_bytes
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan, SpillBlocks, host_device_choices

# The groups of kinds the fill moves to disk, in order (see [Note: fill order]).
FILL_GROUPS = ((BufferKind.EXP_AVG, BufferKind.EXP_AVG_SQ), (BufferKind.MASTER,), (BufferKind.GRADS,))


def block_numels(model: ModelShape) -> list[int]:
    """Elements of each block in the runtime's order: embedding, L layers, head."""
    return [model.numel_embedding] + [model.numel_layer] * model.num_layers + [model.numel_head]


# Spilled.of's placements by (model, spill, spill_blocks, optimizer mode, state bytes), up to PLACEMENTS_KEPT.
PLACEMENTS_KEPT = 4096
_PLACEMENTS: dict[tuple, "Spilled"] = {}


@dataclass(frozen=True)
class Spilled:
    """A plan's placement on one model: per kind, the spilled blocks, their elements and file bytes."""

    blocks: dict[BufferKind, frozenset[int]]
    numels: tuple[int, ...]  # every block's elements
    state_bytes: int = 4  # bytes per element of AdamW m and v (Workload.state_bytes): 4, or 2 in bf16

    @classmethod
    def of(cls, model: ModelShape, plan: Plan, state_bytes: int = 4) -> "Spilled":
        """The placement of ``plan`` on ``model``: the same object for the same model, placement fields and state
        bytes (the search prices one placement thousands of times; a Spilled is never changed)."""
        key = (model, plan.spill, plan.spill_blocks, plan.optimizer_mode, state_bytes)  # what placement() reads
        found = _PLACEMENTS.get(key)
        if found is None:
            if len(_PLACEMENTS) >= PLACEMENTS_KEPT:
                _PLACEMENTS.clear()
            numels = block_numels(model)
            found = _PLACEMENTS[key] = cls(placement(plan, len(numels)), tuple(numels), state_bytes)
        return found

    @functools.cached_property
    def kinds(self) -> tuple[BufferKind, ...]:
        """The kinds with at least one block on disk (k of the staging term)."""
        return tuple(k for k in BufferKind if self.blocks.get(k))

    def numel(self, kind: BufferKind) -> int:
        """Ns_k: elements of ``kind`` on disk."""
        return self._sums.get(kind, (0, 0))[0]

    def element_bytes(self, kind: BufferKind) -> int:
        """s_k: bytes of one element of ``kind``, in RAM and in its spill file (``buffer_kinds.element_bytes``)."""
        return element_bytes(kind, self.state_bytes)

    def file_bytes(self, kind: BufferKind) -> int:
        """F_k: bytes of ``kind``'s spill file: sum over its spilled blocks of the block x s_k rounded up to 4 KiB."""
        return self._sums.get(kind, (0, 0))[1]

    @functools.cached_property
    def _sums(self) -> dict[BufferKind, tuple[int, int]]:
        """Per spilled kind, (Ns_k, F_k), summed once."""
        return {kind: (sum(self.numels[b] for b in blocks),
                       sum(spill_block_bytes(self.numels[b], self.element_bytes(kind)) for b in blocks))
                for kind, blocks in self.blocks.items()}

    def block_kinds(self, b: int) -> int:
        """How many of block b's kinds live on disk."""
        return self.kinds_by_block[b]

    @functools.cached_property
    def kinds_by_block(self) -> tuple[int, ...]:
        """``block_kinds`` of every block, counted once (the cost model asks each block's every time it prices)."""
        return tuple(sum(1 for blocks in self.blocks.values() if b in blocks) for b in range(len(self.numels)))

    @functools.cached_property
    def disk_bytes_by_block(self) -> tuple[int, ...]:
        """``block_disk_bytes`` of every block over all kinds, once."""
        return tuple(self.block_disk_bytes(b) for b in range(len(self.numels)))

    def disk_bytes_per_element(self, b: int, kinds: tuple[BufferKind, ...] = tuple(BufferKind)) -> int:
        """The sum of s_k over those of block b's kinds among ``kinds`` (default: all) that spill."""
        return sum(self.element_bytes(k) for k in kinds if b in self.blocks.get(k, ()))

    def block_disk_bytes(self, b: int, kinds: tuple[BufferKind, ...] = tuple(BufferKind)) -> int:
        """Bytes of block b on disk among ``kinds`` (default: all): numel x ``disk_bytes_per_element`` (unrounded:
        what one pass over the block reads or writes)."""
        return self.numels[b] * self.disk_bytes_per_element(b, kinds)


def fill_levels(model: ModelShape, deferred: bool) -> int:
    """The number of levels above 0 of the fill: nb per group, the gradients' only in deferred mode."""
    nb = model.num_layers + 2
    return nb * (len(FILL_GROUPS) if deferred else len(FILL_GROUPS) - 1)


def at_level(plan: Plan, model: ModelShape, level: int, host: bool = False) -> Plan:
    """``plan`` with the placement of fill level ``level`` (see [Note: fill order]): "none" at 0, "optimizer"
    where every block's m and v spill and nothing else, "all" at the last level, else "blocks". Above level 0
    AdamW runs on its worker thread (``Plan.adam_thread``: only a worker waits for spill I/O), and compute runs in
    place on a CPU device in one process (``host``) up to level nb, where only m and v spill
    (``plan.host_device_choices``); above it a master or gradient spills, so there is no host copy to use."""
    deferred = plan.optimizer_mode == "deferred"
    nb = model.num_layers + 2
    assert 0 <= level <= fill_levels(model, deferred)
    if level == 0:
        return plan.replace(spill="none", spill_blocks=None)
    # what the level's masters and gradients allow
    choices = host_device_choices(host, plan.optimizer_mode, "optimizer" if level <= nb else "all")
    if level == nb:
        return plan.replace(spill="optimizer", spill_blocks=None, **choices)
    if level == fill_levels(model, deferred):
        return plan.replace(spill="all", spill_blocks=None, **choices)
    return plan.replace(spill="blocks", spill_blocks=_level_blocks(nb, level), **choices)


@functools.lru_cache(maxsize=1024)
def _level_blocks(nb: int, level: int) -> SpillBlocks:
    """The blocks of fill level ``level`` (0 < level, below the last) on a model of ``nb`` blocks, per kind: the
    last blocks of each group's kinds. One object per level (a SpillBlocks is never changed; the fill asks each
    level of each candidate)."""
    named: dict[str, tuple[int, ...]] = {}
    for g, kinds in enumerate(FILL_GROUPS):
        count = max(0, min(nb, level - g * nb))
        for kind in kinds:
            named[kind.value] = tuple(range(nb - count, nb))  # the last ``count`` blocks
    return SpillBlocks(**named)


_LABELS = {"none": "nothing", "optimizer": "AdamW m, v", "all": "fp32 master, m, v, grads"}
_KIND_LABELS = (("exp_avg", "m"), ("exp_avg_sq", "v"), ("master", "fp32 master"), ("grads", "grads"))


def label(plan: Plan) -> str:
    """What a plan spills, for people: "AdamW m, v", or for a per-block placement e.g. "m, v of 12 blocks,
    fp32 master of 3 blocks"."""
    if plan.spill != "blocks":
        return _LABELS[plan.spill]
    assert plan.spill_blocks is not None
    by_count: dict[int, list[str]] = {}
    for kind, name in _KIND_LABELS:
        n = len(plan.spill_blocks.blocks(kind))
        if n:
            by_count.setdefault(n, []).append(name)
    return ", ".join(f"{', '.join(names)} of {n} block{'s' if n > 1 else ''}" for n, names in by_count.items())


def disk_traffic_bytes(nvme_bytes: int) -> int:
    """Bytes the spill disk moves per step, for ``nvme_bytes`` of spill files: every spilled kind is read once and
    written once per step (master, m and v around AdamW; deferred gradients written in backward, read by AdamW)."""
    return 2 * nvme_bytes
