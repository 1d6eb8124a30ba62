"""The AdamW arithmetic both optimizers run: torch's fused AdamW kernel on the views of a block's flat buffers.

``torch._fused_adamw_`` is what ``torch.optim.AdamW(fused=True)`` runs, on the CPU and on CUDA alike; it is
called once for a block's parameters with weight decay and once for those without, on lists of views of the
flat fp32 master, gradient, m and v. Views, not one flat range: the kernel's vectorized body and its scalar
tail round differently, so only the same tensor boundaries as ``torch.optim.AdamW`` give the same bits. The
CPU worker (cpu_adamw.py) runs it on host buffers, the device AdamW (device_adamw.py) on a resident block's
device buffers: on a CPU device the same kernel on the same views, so the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain.runtime.model.templates import BlockLayout


@dataclass(frozen=True)
class AdamHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    skip_nonfinite: bool = False  # see [Note: non-finite updates] in cpu_adamw.py


def fused_adamw(hyper: AdamHyper, layout: BlockLayout, lo: int, n: int, flats: tuple[torch.Tensor, ...],
                step: torch.Tensor, found_inf: torch.Tensor | None = None) -> None:
    """torch's fused AdamW on the views of elements [lo, lo + n) of a block laid out as ``layout``; ``flats``: its
    fp32 master, grads, m and v, each holding just those n elements (on one device); ``step``: the block's step
    count (a float32 scalar on that device), already advanced; ``found_inf`` (an fp32 scalar there, or None): 1
    leaves every buffer as it is (the kernel's own skip). Once for the entries with weight decay, once without."""
    skip = {} if found_inf is None else {"found_inf": found_inf}
    h = hyper
    entries, views = layout.range_views(flats, lo, n)
    for decay, wd in ((True, h.weight_decay), (False, 0.0)):
        pick = [i for i, e in enumerate(entries) if e.decay == decay]
        if pick:
            p, g, ea, eas = ([vs[i] for i in pick] for vs in views)
            torch._fused_adamw_(
                p, g, ea, eas, [], [step] * len(pick),
                lr=h.lr, beta1=h.beta1, beta2=h.beta2, weight_decay=wd, eps=h.eps,
                amsgrad=False, maximize=False, **skip,
            )
