"""AdamW with bf16 m and v ([Note: bf16 optimizer state]): one pass per element, compiled or in torch, the same bits.

The update of element i (every operation an IEEE fp32 one, rounded on its own; ``Constants`` holds the scalars,
each rounded to fp32 once):

    g = grad * clip                       (clip: the clipping coefficient; skipped where it is 1)
    p = master * decay                    (decay = 1 - lr * weight_decay; skipped where it is 1: no decay)
    m = widen(m) * beta1 + g * (1 - beta1)
    v = widen(v) * beta2 + (g * g) * (1 - beta2)
    master = p - (m * step_size) / (sqrt(v) * inv_bias2_sqrt + eps)
                                          (step_size = lr / (1 - beta1^t), inv_bias2_sqrt = 1 / sqrt(1 - beta2^t))
    m, v = round_stochastic(m, v)         (stochastic_rounding.py: the noise of (t, block, i))

torch's fused AdamW's formula with the same hyper-parameters; the gradient buffer is read, not scaled in place.
``update_entries`` runs it on a range of a block, one call per parameter (weight decay or not), through the
compiled loop (native_adamw.py) where it builds here, else ``torch_update``.
"""
from __future__ import annotations

import math
import struct
import warnings
from dataclasses import astuple, dataclass
from typing import Sequence

import torch

from megatrain.runtime.model.templates import BlockLayout
from megatrain.runtime.optim import native_adamw
from megatrain.runtime.optim.adamw_kernel import AdamHyper
from megatrain.runtime.optim.stochastic_rounding import MIX, noise, noise_base, round_stochastic

# Elements the torch fallback computes at a time (its temporaries: about 40 bytes each). It runs at about 0.03
# Gparam/s on one thread of this project's CPU, against 0.9-1.0 for the compiled loop: its 32-bit hash in int64
# torch ops is most of it.
TORCH_CHUNK = 1 << 16


def f32(x: float) -> float:
    """x rounded to the nearest fp32 (a Python float that converts to fp32 exactly)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@dataclass(frozen=True)
class Constants:
    """The fp32 scalars of one update, in the compiled kernel's argument order."""

    clip: float
    decay: float
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    step_size: float
    inv_bias2_sqrt: float
    eps: float

    @classmethod
    def of(cls, hyper: AdamHyper, step: int, decay: bool, clip: float | None) -> Constants:
        """The scalars of AdamW step ``step`` (1 for the first) with ``hyper``; ``decay``: the parameter has
        weight decay; ``clip``: the clipping coefficient (an fp32 value), None without clipping."""
        h = hyper
        return cls(clip=f32(1.0 if clip is None else clip), decay=f32(1.0 - h.lr * h.weight_decay if decay else 1.0),
                   beta1=f32(h.beta1), one_minus_beta1=f32(1.0 - h.beta1), beta2=f32(h.beta2),
                   one_minus_beta2=f32(1.0 - h.beta2), step_size=f32(h.lr / (1.0 - h.beta1 ** step)),
                   inv_bias2_sqrt=f32(1.0 / math.sqrt(1.0 - h.beta2 ** step)), eps=f32(h.eps))


def kernel() -> tuple[object | None, str]:
    """(the compiled kernel, "") once built and loaded in this process, else (None, why): built on the first call
    (about a second; cached across processes), so the AdamW worker calls it before the first step."""
    return native_adamw.load(MIX)


def uses_compiled_kernel() -> bool:
    """Whether bf16-state updates in this process run the compiled loop (else torch ops, the same bits)."""
    return kernel()[0] is not None


_warned = False


def update(master: torch.Tensor, grads: torch.Tensor, m: torch.Tensor, v: torch.Tensor, base: int,
           c: Constants, compiled: bool = True) -> None:
    """One contiguous run: master, grads (fp32 [n]), m, v (bf16 [n]) updated in place; ``base``: the first
    element's noise input (stochastic_rounding.noise_base). ``compiled``: the compiled loop where it is here
    (False: torch ops, the same bits)."""
    global _warned
    n = master.numel()
    assert grads.numel() == m.numel() == v.numel() == n and m.dtype == v.dtype == torch.bfloat16
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in (master, grads, m, v))
    fn, why = kernel() if compiled else (None, "")
    if fn is None:
        if compiled and not _warned:
            _warned = True
            warnings.warn(f"bf16 AdamW state runs in torch ops, about 30x slower than the compiled kernel ({why}); "
                          "install a C++ compiler (g++) for the fast path: the bits are the same", stacklevel=2)
        torch_update(master, grads, m, v, base, c)
        return
    if n:
        fn(master.data_ptr(), grads.data_ptr(), m.data_ptr(), v.data_ptr(), n, base, *astuple(c))


def torch_update(master: torch.Tensor, grads: torch.Tensor, m: torch.Tensor, v: torch.Tensor, base: int,
                 c: Constants) -> None:
    """``update`` in torch ops, TORCH_CHUNK elements at a time: the compiled loop's bits, op for op (fp32
    multiply, add, subtract, divide and square root, each correctly rounded; no fused multiply-add)."""
    for a in range(0, master.numel(), TORCH_CHUNK):
        z = min(a + TORCH_CHUNK, master.numel())
        g = grads[a:z] * c.clip if c.clip != 1.0 else grads[a:z]  # x 1 skipped, as the compiled loop skips it
        p = master[a:z] * c.decay if c.decay != 1.0 else master[a:z].clone()
        mw = m[a:z].float().mul_(c.beta1).add_(g * c.one_minus_beta1)
        vw = v[a:z].float().mul_(c.beta2).add_((g * g).mul_(c.one_minus_beta2))
        # sqrt in fp64, then rounded: torch's fp32 sqrt (MKL's) is not correctly rounded (about 1 in 140 one ULP
        # off), its fp64 sqrt within a few fp64 ULPs, and the square root of an fp32 never lies within 2^-50
        # (relative) of a midpoint between fp32 neighbours: rounded to fp32 it is the correctly rounded sqrt
        denom = vw.double().sqrt_().float().mul_(c.inv_bias2_sqrt).add_(c.eps)
        master[a:z] = p.sub_((mw * c.step_size).div_(denom))
        bits = noise((base + a) & 0xFFFFFFFF, z - a)
        m[a:z] = round_stochastic(mw, bits & 0xFFFF)
        v[a:z] = round_stochastic(vw, bits >> 16)


def update_entries(hyper: AdamHyper, layout: BlockLayout, lo: int, flats: Sequence[torch.Tensor], step: int,
                   block: int, clip: float | None) -> None:
    """The update of elements [lo, lo + n) of block ``block`` laid out as ``layout``, at AdamW step ``step``:
    ``flats``: its fp32 master and gradient and bf16 m and v, each holding just those n elements; one run per
    parameter (its weight decay), the noise by each element's index in the block."""
    n = flats[0].numel()
    entries, views = layout.range_views(flats, lo, n)
    for i, entry in enumerate(entries):
        master, grads, m, v = (vs[i] for vs in views)
        first = max(entry.offset, lo)
        update(master, grads, m, v, noise_base(step, block, first), Constants.of(hyper, step, entry.decay, clip))
