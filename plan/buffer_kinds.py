"""The host buffer kinds of a model's state, which of them a plan spills, their bytes per element, and the spill
files' alignment.

One definition for both sides: the planner's memory model sizes what the runtime's host store
allocates, so both ask ``placement`` which blocks of which kinds live in spill files instead of RAM.

Pure stdlib: the runtime imports it, and it imports nothing of the runtime.
"""
from __future__ import annotations

import enum
from typing import Mapping

from megatrain.plan.plan import Plan


class BufferKind(enum.StrEnum):
    """One buffer per parameter, kept per block in the host store (or its spill file): fp32, but m and v in the
    AdamW state dtype (``element_bytes``)."""

    MASTER = "master"  # the fp32 master weights
    EXP_AVG = "exp_avg"  # AdamW's first moment (m)
    EXP_AVG_SQ = "exp_avg_sq"  # AdamW's second moment (v)
    GRADS = "grads"  # the fp32 gradients (deferred mode: a whole arena; eager mode: slabs only)


# The kinds a checkpoint saves and an optimizer update rewrites: the training state proper.
STATE_KINDS = (BufferKind.MASTER, BufferKind.EXP_AVG, BufferKind.EXP_AVG_SQ)

# The kinds kept in the AdamW state dtype (fp32, or bf16: [Note: bf16 optimizer state]); the others are fp32.
MOMENT_KINDS = (BufferKind.EXP_AVG, BufferKind.EXP_AVG_SQ)

# Per kind, the blocks (runtime block indices) whose state lives in a spill file; a kind absent: all in RAM.
Placement = Mapping[BufferKind, frozenset[int]]

# Bytes: a spill file holds each block at an offset and length that are multiples of this (O_DIRECT).
SPILL_ALIGN = 4096

# A chunk of a block whose bf16 m or v spills starts on a multiple of these elements. bf16 state's rounding noise
# is each element's own (runtime/optim/stochastic_rounding.py, [Note: bf16 optimizer state]), so any chunking
# gives the block's bits in RAM; the multiple dates from noise keyed per piece of this many elements.
WIDEN_ELEMENTS = 2**20


def element_bytes(kind: BufferKind, state_bytes: int = 4) -> int:
    """Bytes of one element of ``kind``: ``state_bytes`` (4 for fp32 AdamW state, 2 for bf16) for m and v, in RAM
    and in their spill files alike; 4 for the fp32 master and gradients."""
    return state_bytes if kind in MOMENT_KINDS else 4


def spill_chunk_multiple(state_bytes: int) -> int:
    """What ``Plan.spill_chunk_bytes`` must be a multiple of where m or v spill in ``state_bytes``: SPILL_ALIGN
    for fp32 state; 4 x WIDEN_ELEMENTS (4 MiB) for bf16 (see WIDEN_ELEMENTS)."""
    return SPILL_ALIGN if state_bytes == 4 else 4 * WIDEN_ELEMENTS


def placement(plan: Plan, num_blocks: int) -> dict[BufferKind, frozenset[int]]:
    """Per kind, the blocks of a model of ``num_blocks`` blocks that ``plan`` keeps in spill files (only the kinds
    with at least one): ``Plan.spill_placement``. Eager mode passes its gradients through RAM slabs, never
    through a file, so it spills no gradient whatever the plan says."""
    deferred = plan.optimizer_mode == "deferred"
    out = {}
    for name, blocks in plan.spill_placement(num_blocks).items():
        kind = BufferKind(name)
        if blocks and (kind is not BufferKind.GRADS or deferred):
            out[kind] = frozenset(blocks)
    return out


def load_bytes(compute_bytes: int, weights_cast: str) -> int:
    """Bytes per weight element a load copies to the device: the fp32 master's where compute is fp32 or the
    plan rounds on the device (``Plan.weights_cast``; no shadow in RAM then), else the compute-dtype shadow's."""
    return 4 if compute_bytes == 4 or weights_cast == "device" else compute_bytes


def has_shadow(compute_bytes: int, weights_cast: str) -> bool:
    """Whether host RAM holds a compute-dtype shadow of the master for the loads (bf16 / fp16, cast on the host)."""
    return load_bytes(compute_bytes, weights_cast) != 4


def crosses_pcie(kind: BufferKind, master_loaded: bool) -> bool:
    """Whether ``kind``'s RAM arena is copied to or from the GPU, and so is pinned with CUDA: the gradients (GPU to
    host) always; the master where the loads copy it (``master_loaded``: fp32 compute, or the cast on the
    device); never m and v, which only AdamW on the CPU reads. (A shadow and the gradient slabs cross too.)"""
    return kind is BufferKind.GRADS or (kind is BufferKind.MASTER and master_loaded)


def spilled_kinds(spilled: Placement) -> tuple[BufferKind, ...]:
    """The kinds with at least one block in a spill file, in ``BufferKind`` order."""
    return tuple(k for k in BufferKind if spilled.get(k))


def spill_block_bytes(numel: int, element: int = 4) -> int:
    """Bytes a block of ``numel`` elements of ``element`` bytes (``element_bytes``) takes in a spill file (or one
    staging buffer of ``numel`` elements): rounded up to SPILL_ALIGN."""
    return -(-numel * element // SPILL_ALIGN) * SPILL_ALIGN


def spill_chunks(numel: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The (first element, elements) pieces a spilled block of ``numel`` elements is read, updated and written in,
    the same for all its kinds: ``chunk_bytes / 4`` elements each (``chunk_bytes`` of fp32, a multiple of
    SPILL_ALIGN; half that of bf16 m and v), the last one shorter.
    Piece boundaries fall on multiples of 1024 elements, so torch's fused AdamW kernel (vectorised over
    16-element cache lines, scalar only on each tensor's tail) gives the same bits in pieces as whole."""
    assert chunk_bytes % SPILL_ALIGN == 0 and chunk_bytes > 0
    step = chunk_bytes // 4
    return [(lo, min(step, numel - lo)) for lo in range(0, numel, step)] or [(0, 0)]


def spill_chunk_numel(largest_block: int, chunk_bytes: int) -> int:
    """Elements of the largest piece of any block (what one staging buffer or slab holds), rounded up to
    SPILL_ALIGN in fp32: min(chunk, largest block x 4 rounded up to 4 KiB) / 4."""
    return min(chunk_bytes, spill_block_bytes(largest_block)) // 4
