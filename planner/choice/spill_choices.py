"""The spill settings the plan search tries: the I/O unit (chunk), the staging depths, and O_DIRECT or not. Pure
stdlib."""
from __future__ import annotations

from typing import Callable

from megatrain.planner.costs import spill_placement
from megatrain.plan.buffer_kinds import spill_chunk_multiple, spill_chunks
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan

# Staging sets between disk and AdamW: 1 (least RAM, no read-ahead), 3 (reads ahead, writes behind), and deeper
# read-ahead into the backward's idle disk time (spill_timing): the cost model times what they buy, the memory
# model what they cost, and near-ties go to the fewest.
SPILL_STAGING = (1, 3, 8, 24, 64)


def spill_chunk_bytes(model: ModelShape, state_bytes: int = 4) -> int:
    """The spill I/O unit of the search's plans: Plan's default, or one layer's bytes where a layer is smaller (4 KiB
    rounded: chunk edges on 1024-element multiples; with bf16 AdamW state 4 MiB rounded, on the stochastic rounding's
    pieces: ``buffer_kinds.spill_chunk_multiple``). The embedding and an untied head are then cut into chunks of a
    layer's size, so every staging set holds as much as the memory model's Ck charges it for."""
    multiple = spill_chunk_multiple(state_bytes)
    return min(Plan.spill_chunk_bytes, -(-model.numel_layer * 4 // multiple) * multiple)


def spill_staging_choices(model: ModelShape, chunk_bytes: int) -> tuple[int, ...]:
    """SPILL_STAGING, each capped at the chunks of one update pass over every block (``buffer_kinds.spill_chunks``):
    a staging set holds one chunk, so sets beyond that many are never filled, though the memory model counts them."""
    return tuple(sorted({min(s, update_pass_chunks(model, chunk_bytes)) for s in SPILL_STAGING}))


def update_pass_chunks(model: ModelShape, chunk_bytes: int) -> int:
    """The chunks of one update pass over every block (``buffer_kinds.spill_chunks``): the most staging sets
    that are ever filled."""
    return sum(len(spill_chunks(n, chunk_bytes)) for n in spill_placement.block_numels(model))


def most_staging(model: ModelShape, plan: Plan, fits: Callable[[int], bool]) -> int:
    """The most staging sets ``plan`` may have (``fits(sets)``: its memory within every budget, growing with the
    sets; ``plan.spill_staging`` fits), up to the chunks of one update pass over the blocks with something on disk
    (a set stages a chunk of those only; more are never filled), and never fewer than it has. The search
    takes them where they cost no time in its model: the read-ahead's depth is worth more than the model prices
    it, since a disk moves bytes faster with more requests in flight, which its one rate per direction does not
    see. Measured on the 3.2B shape, eager, spill all, 2 cores, in two sittings: 64 sets against 24, 30.3-34.0 s
    against 33.3-36.8 s, then 28.4-33.2 s against 33.8-36.4 s (the disk busy 26.6-27.8 s for 86-90 GB moved,
    against 29.2-32.1 s for 88-93 GB), where the model priced the two within 1%."""
    spilled = spill_placement.Spilled.of(model, plan)
    staged = sum(len(spill_chunks(n, plan.spill_chunk_bytes)) for b, n in enumerate(spilled.numels)
                 if spilled.block_kinds(b))
    lo, hi = plan.spill_staging, max(plan.spill_staging, staged)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def spill_io_choices(hw: HardwareProfile | None) -> dict[str, object]:
    """The spill I/O settings the profile decides: O_DIRECT unless the profile says buffered
    (``disk_direct_faster``: the filesystem refused O_DIRECT, or a user's choice), for both directions: reads
    buffered beside O_DIRECT writes (``Plan.io_direct_reads``) are a user's choice too, since the page cache's
    copies take CPU from compute (a spilled 3.2B step on 2 cores: 53.5 s with buffered reads against 48.3 with
    O_DIRECT ones, though the probe read buffered 1.8x faster)."""
    return {"io_direct": hw is None or hw.disk_direct_faster is not False}
