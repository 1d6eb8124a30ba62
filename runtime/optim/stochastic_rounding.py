"""Compact AdamW state ([Note: bf16 optimizer state]): m and v kept in bf16, updated in fp32, rounded back at random.

[Note: bf16 optimizer state]
With ``OptimizerConfig(state_dtype="bf16")`` the host store keeps AdamW's m and v as bf16 (8 instead of 12 bytes
of host state per parameter, with the fp32 master). torch's fused CPU AdamW takes one dtype for all its lists, so
each piece of ``WIDEN_ELEMENTS`` elements is widened to fp32 scratch, updated there with the same kernel and
hyper-parameters as fp32 state, and narrowed back with stochastic rounding: uniform noise in [0, 2^16) is added to
the fp32 bits below bf16's last bit, then the low 16 bits are dropped. The result is the bf16 value above or
below with probabilities that make it unbiased in expectation; round-to-nearest would lose every update smaller
than half a bf16 ULP of v (beta2 close to 1: v hardly moves between steps), stochastic rounding keeps them on
average. The noise comes from a generator seeded by a hash of (AdamW step, block, first element, m or v): the
same key gives the same noise, so a run resumed from a checkpoint writes the same bits as one never
interrupted, whatever the thread that runs it. The fp32 master is updated exactly as with fp32 state.
m and v may spill ([Note: spill]): their files and staging buffers hold bf16 too, and the AdamW worker widens and
rounds the staged chunk as it would the RAM block. Where they spill, a chunk is a multiple of WIDEN_ELEMENTS
(``buffer_kinds.spill_chunk_multiple``), so a spilled block is rounded in the same pieces with the same keys as
in RAM: the same bits.
"""
from __future__ import annotations

import hashlib

import torch

# WIDEN_ELEMENTS: elements widened to fp32 at a time, 2 x 4 MiB of scratch for m and v (a multiple of 1024, so
# the fused kernel's vector body and scalar tail fall the same way in every run). Spill chunks of bf16 m and v
# start on its multiples (buffer_kinds.spill_chunk_multiple), so a spilled block walks the same pieces as in RAM.
from megatrain.planner.buffer_kinds import WIDEN_ELEMENTS

__all__ = ["WIDEN_ELEMENTS", "STATE_DTYPES", "noise_seed", "round_stochastic", "widened_pieces"]

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def noise_seed(step: int, block: int, offset: int, which: int) -> int:
    """The generator seed of one piece's noise: a hash of (AdamW step, block, first element, 0 for m / 1 for v)."""
    key = f"{step}:{block}:{offset}:{which}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def round_stochastic(src: torch.Tensor, dst: torch.Tensor, seed: int) -> None:
    """dst (bf16 [n]) = src (fp32 [n], contiguous; overwritten) rounded at random: up with probability equal to
    the fraction of a bf16 ULP that truncation would drop. Deterministic for the same ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 1 << 16, src.shape, generator=gen, dtype=torch.int32)
    bits = src.view(torch.int32)
    bits.add_(noise).bitwise_and_(-(1 << 16))  # sign-magnitude: noise grows the magnitude, the mask truncates it
    dst.copy_(bits.view(torch.bfloat16)[1::2])  # little-endian: the high half of each fp32 is its bf16


def widened_pieces(n: int) -> list[tuple[int, int]]:
    """The (first element, elements) pieces of an n-element range widened to fp32 one at a time."""
    return [(a, min(WIDEN_ELEMENTS, n - a)) for a in range(0, n, WIDEN_ELEMENTS)] or [(0, 0)]
