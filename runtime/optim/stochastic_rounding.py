"""Compact AdamW state ([Note: bf16 optimizer state]): m and v kept in bf16, updated in fp32, rounded back at random.

[Note: bf16 optimizer state]
With ``OptimizerConfig(state_dtype="bf16")`` the host store keeps AdamW's m and v as bf16 (8 instead of 12 bytes
of host state per parameter, with the fp32 master). Each element's update is one pass (bf16_adamw.py): m and v
widened to fp32 (exact), AdamW on the fp32 master with the same hyper-parameters as fp32 state (the clip
coefficient and weight decay included), then the new m and v narrowed back with stochastic rounding: 16 bits of
uniform noise are added to the fp32 bits below bf16's last bit, then the low 16 bits are dropped. The result is
the bf16 value above or below with probabilities that make it unbiased in expectation; round-to-nearest would lose
every update smaller than half a bf16 ULP of v (beta2 close to 1: v hardly moves between steps), stochastic
rounding keeps them on average. The pass runs as a compiled loop (native_adamw.py) or, where no C++ compiler is at
hand, as torch ops that compute the same bits (``bf16_adamw.torch_update``); both are IEEE fp32 operations one at a
time (no fused multiply-add), so a run resumed on either writes the bits the other would. The master's bits are
not torch's fused AdamW's (the same formula, its own order of operations): bf16 and fp32 state differ anyway.

The noise is counter-based: a pure function of a key and the element's index, with no generator state. The key
of an AdamW step of a block is a 32-bit hash of (step, block) (``noise_key``); element i of the block (its index
in the block's flat buffers) gets x = mix((key + i) mod 2^32), mix a bijection of the 32-bit integers (xor-shifts
and multiplications by odd constants, ``mix``); the low 16 bits of x are m's noise, the high 16 bits v's. For any
element, over a uniformly random key, key + i is uniform, so x is uniform on the 2^32 values: m's and v's noise
are each exactly uniform on [0, 2^16) and independent of each other, and each rounding is exactly unbiased in
expectation; the keys of different steps are independent hashes, so an element's noise is drawn afresh each step.
Blocks hold fewer than 2^32 elements, so within one step no two elements share their input to mix.

The same key gives the same noise, so a run resumed from a checkpoint writes the same bits as one never
interrupted, whatever the threads or chunks that run it (each element's noise is its own index's): a checkpoint
stores no generator state, and m and v spilled to files ([Note: spill], bf16 there too) round the same as in RAM,
chunk by chunk.
"""
from __future__ import annotations

import hashlib

import torch

__all__ = ["STATE_DTYPES", "MIX", "noise_key", "noise_base", "mix", "noise", "round_stochastic"]

STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# mix's two odd multipliers, each under 2^31 so a product of a 32-bit value fits in an int64 without overflow
# (torch's integer ops, for the fallback and the tests); the shifts 16, 15, 16 between them (native_adamw.SOURCE).
MIX = (0x7FEB352D, 0x5BD1E995)
_MASK32 = 0xFFFFFFFF


def noise_key(step: int, block: int) -> int:
    """The 32-bit noise key of AdamW step ``step`` of ``block``: a hash of the pair."""
    digest = hashlib.blake2b(f"{step}:{block}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def noise_base(step: int, block: int, first: int) -> int:
    """mix's input for block element ``first`` (the next elements' follow it, modulo 2^32): the key plus the index."""
    return (noise_key(step, block) + first) & _MASK32


def mix(x: torch.Tensor) -> torch.Tensor:
    """int64 [n] of 32-bit values -> the same shape, each x mixed (a bijection of the 32-bit integers):
    x ^= x >> 16; x *= MIX[0]; x ^= x >> 15; x *= MIX[1]; x ^= x >> 16 (modulo 2^32). In place on ``x``."""
    x ^= x >> 16
    x.mul_(MIX[0]).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(MIX[1]).bitwise_and_(_MASK32)
    x ^= x >> 16
    return x


def noise(base: int, n: int) -> torch.Tensor:
    """int64 [n]: the 32 noise bits of n consecutive elements, the first's mix input ``base`` (``noise_base``):
    m's noise in the low 16 bits, v's in the high 16."""
    return mix(torch.arange(base, base + n, dtype=torch.int64).bitwise_and_(_MASK32))


def round_stochastic(src: torch.Tensor, noise16: torch.Tensor) -> torch.Tensor:
    """bf16 [n]: ``src`` (fp32 [n]) rounded at random with ``noise16`` (int64 [n], values in [0, 2^16)): the high
    half of (src's bits + noise) modulo 2^32, sign-magnitude, so the noise grows the magnitude and dropping the low
    half truncates it; up with probability equal to the fraction of a bf16 ULP that truncation would drop."""
    bits = src.view(torch.int32).to(torch.int64).bitwise_and_(_MASK32).add_(noise16)
    high = bits.bitwise_right_shift_(16).bitwise_and_(0xFFFF)
    return high.sub_((high >> 15) << 16).to(torch.int16).view(torch.bfloat16)  # as int16: the same 16 bits
