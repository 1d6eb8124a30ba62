"""Compact AdamW state ([Note: bf16 optimizer state]): m and v kept in bf16, updated in fp32, rounded back at random.

[Note: bf16 optimizer state]
With ``OptimizerConfig(state_dtype="bf16")`` the host store keeps AdamW's m and v as bf16 (8 instead of 12 bytes
of host state per parameter, with the fp32 master). torch's fused CPU AdamW takes one dtype for all its lists, so
each chunk of m and v is widened to fp32 scratch, updated there with the same kernel and hyper-parameters as fp32
state, and narrowed back with stochastic rounding: uniform noise in [0, 2^16) is added to the fp32 bits below
bf16's last bit, then the low 16 bits are dropped. The result is the bf16 value above or below with probabilities
that make it unbiased in expectation; round-to-nearest would lose every update smaller than half a bf16 ULP of v
(beta2 close to 1: v hardly moves between steps), stochastic rounding keeps them on average. The fp32 master is
updated exactly as with fp32 state.

The noise is counter-based: a pure function of a key and the element's index, with no generator state. A piece
of ``WIDEN_ELEMENTS`` elements (2^20) has two keys, hashes of (AdamW step, block, the piece's first element, 0 for
m / 1 for v), each reduced to an offset o in [0, 2^16); element i of the piece gets ``NOISE[(o + i) mod 2^16]``
from m's or v's table. A table holds every 16-bit value once (h(i) for i < 2^16, h a bijective integer hash:
odd multiplications, an addition and xor-shifts modulo 2^16), so for any element, over a uniformly random
offset, the noise is exactly uniform and the rounding exactly unbiased in expectation; the offsets of different
steps are independent hashes, so an element's noise is drawn afresh each step, and m's and v's are independent.
Within one step, elements 2^16 apart in a piece share their noise (the table's period): each element stays
unbiased, only those far-apart roundings are alike. Adding the noise is one pass over m and v together (a view
of the tables, 1 MiB with their wrap-around copies, that stays in L2); an integer hash per element in torch ops
would take about ten passes, more than the AdamW kernel itself, and a generator's draw runs on one thread.

The same key gives the same noise, so a run resumed from a checkpoint writes the same bits as one never
interrupted, whatever the thread that runs it; a checkpoint stores no generator state. The pieces are walked in
chunks of ``cache_chunk`` elements (2^17 per intra-op thread: the two fp32 scratch chunks of a thread's share stay
in its L2 between widening, AdamW and rounding, and every thread has work); a chunk never straddles a piece and
its noise is the piece's at its position, and chunk edges fall on multiples of 1024 (the fused
kernel's vector body and scalar tail fall the same way), so the bits do not depend on the thread count.
m and v may spill ([Note: spill]): their files and staging buffers hold bf16 too, and the AdamW worker widens and
rounds the staged chunk as it would the RAM block. Where they spill, a chunk is a multiple of WIDEN_ELEMENTS
(``buffer_kinds.spill_chunk_multiple``), so a spilled block is rounded in the same pieces with the same keys as
in RAM: the same bits.
"""
from __future__ import annotations

import functools
import hashlib

import torch

# WIDEN_ELEMENTS: the elements of a piece, one noise key each (a multiple of 1024). Spill chunks of bf16 m and v
# start on its multiples (buffer_kinds.spill_chunk_multiple), so a spilled block walks the same pieces as in RAM.
from megatrain.plan.buffer_kinds import WIDEN_ELEMENTS

__all__ = ["WIDEN_ELEMENTS", "STATE_DTYPES", "CHUNK_PER_THREAD", "NOISE_PERIOD", "noise_key", "noise_at",
           "noise_table", "round_stochastic", "cache_chunk", "widened_chunks"]

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Elements per intra-op thread in one widened chunk: 2 x 512 KiB of fp32 scratch for m and v per thread (in L2).
CHUNK_PER_THREAD = 2**17
# NOISE_PERIOD: the noise of a piece repeats every 2^16 elements (each 16-bit value once in every period).
NOISE_PERIOD = 2**16
assert WIDEN_ELEMENTS % NOISE_PERIOD == 0 and CHUNK_PER_THREAD % NOISE_PERIOD == 0
_LOW_HALF_OFF = torch.tensor(-(1 << 16), dtype=torch.int32)  # the mask that keeps each fp32's bf16 half
# Odd multipliers and the increment of the index hash, per table (m's, v's).
_HASHES = (((0x9E37, 0x5BD1, 0xC2B3), 0x3C6F), ((0x7FEB, 0x846D, 0x2C1B), 0x1B87))


@functools.cache
def noise_table() -> torch.Tensor:
    """int32 [4 x NOISE_PERIOD] (1 MiB: stays in L2): m's noise by index, twice over (so the period from any
    offset is contiguous), then v's likewise. Index i's noise is h(i), h a bijection of the 16-bit integers
    (multiplications by odd constants, an addition and xor-shifts, modulo 2^16): every 16-bit value once per
    period, in an order without visible pattern."""
    mask = NOISE_PERIOD - 1
    tables = []
    for mults, add in _HASHES:
        h = torch.arange(NOISE_PERIOD, dtype=torch.int64)
        for mult in mults:
            h = (h * mult + add) & mask
            h ^= h >> 7
        tables += [h.to(torch.int32)] * 2
    return torch.cat(tables)


def noise_key(step: int, block: int, offset: int, which: int) -> int:
    """The noise offset of one piece, in [0, NOISE_PERIOD): a hash of (AdamW step, block, the piece's first
    element, 0 for m / 1 for v)."""
    key = f"{step}:{block}:{offset}:{which}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % NOISE_PERIOD


def noise_at(step: int, block: int, first: int) -> tuple[int, int]:
    """Where in ``noise_table`` the noise of m and of v starts for the elements from block element ``first`` on
    (within one piece): its piece's offset (``noise_key``) plus the position, modulo the period; v's in its half."""
    piece = first - first % WIDEN_ELEMENTS
    return ((noise_key(step, block, piece, 0) + first) % NOISE_PERIOD,
            2 * NOISE_PERIOD + (noise_key(step, block, piece, 1) + first) % NOISE_PERIOD)


def _noise(at: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """The noise of ``len(at)`` rows ([rows, n] or [rows, periods, NOISE_PERIOD]; n <= NOISE_PERIOD), row r from
    ``noise_table()[at[r]]`` on: a view, each period the same."""
    table = noise_table()
    step = at[-1] - at[0] if len(at) > 1 else 0
    assert all(a <= b for a, b in zip(at, at[1:])) and at[-1] % (2 * NOISE_PERIOD) < NOISE_PERIOD
    strides = (step, 1) if len(shape) == 2 else (step, 0, 1)
    return table.as_strided(shape, strides, at[0])


def round_stochastic(src: torch.Tensor, dst: list[torch.Tensor], at: tuple[int, ...]) -> None:
    """dst[r] (bf16 [n]) = src[r] (fp32 [rows, n], rows of contiguous elements; overwritten) rounded at random:
    up with probability equal to the fraction of a bf16 ULP that truncation would drop. at[r]: where src[r]'s
    noise starts in ``noise_table`` (``noise_at``: m's row, then v's). The same places give the same bits."""
    rows, n = src.shape
    assert len(dst) == len(at) == rows
    bits = src.view(torch.int32)
    whole = n - n % NOISE_PERIOD
    if whole:  # sign-magnitude: the noise grows the magnitude, dropping the low half truncates it
        shape = (rows, whole // NOISE_PERIOD, NOISE_PERIOD)
        bits[:, :whole].view(shape).add_(_noise(at, shape))
    if whole < n:
        bits[:, whole:].add_(_noise(at, (rows, n - whole)))
    bits.bitwise_and_(_LOW_HALF_OFF)
    for r, d in enumerate(dst):
        d.copy_(src[r])  # exact: the low 16 bits are zero, round-to-nearest has nothing to round


def cache_chunk(threads: int) -> int:
    """Elements widened at a time on ``threads`` intra-op threads: CHUNK_PER_THREAD each (threads rounded up to
    a power of two), at most a piece: a power of two, so chunks never straddle a piece."""
    return min(WIDEN_ELEMENTS, CHUNK_PER_THREAD * (1 << max(0, threads - 1).bit_length()))


def widened_chunks(n: int, first: int, chunk: int) -> list[tuple[int, int]]:
    """The (first element, elements) chunks of an n-element range starting at block element ``first`` (a
    multiple of ``chunk``, a power of two dividing WIDEN_ELEMENTS), widened one at a time."""
    assert first % chunk == 0 and WIDEN_ELEMENTS % chunk == 0
    return [(a, min(chunk, n - a)) for a in range(0, n, chunk)] or [(0, 0)]
