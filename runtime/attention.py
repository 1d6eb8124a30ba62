"""Causal attention that is safe at any length: SDPA with ``is_causal=True``, no mask, heads in groups.

[Note: head groups]
A flash kernel indexes some tensors in 32 bits, so no tensor one call sees may
reach 2^31 elements. ``head_groups`` splits the heads into groups small enough:
whole kv heads with the query heads that share them (GQA's sharing kept), or,
when one kv head's queries are too many, runs of those queries against that
one kv head. Heads are independent, so the split is exact: each group's output
is the one-call output's slice (bitwise on the CPU, where it is tested).

Causal alignment: every call sees the whole sequence of queries and keys, so
``is_causal=True`` (upper-left) is the causal mask; queries are never chunked.

Backend: on CUDA in bf16 / fp16 the flash kernel is required (``sdpa_kernel``
restricted to it): where it cannot run the call raises ``AttentionBackendError``
in one line rather than falling back to the math kernel, whose [S, S] scores
do not fit at long context. fp32 and the CPU keep torch's own choice.
Memory per call: q, output and (flash backward) an fp32 dQ of the group's
query heads, k and v of its kv heads; the planner counts one group at a time.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .errors import AttentionBackendError

MAX_ELEMENTS = 2**31 - 1  # per tensor of one SDPA call


def head_groups(batch: int, seq: int, head_dim: int, n_heads: int, n_kv_heads: int,
                max_elements: int = MAX_ELEMENTS) -> list[tuple[slice, slice]]:
    """(query heads, kv heads) of each call, in order, covering every head once.

    With n_rep = n_heads / n_kv_heads query heads per kv head: the most kv heads g (a divisor of
    n_kv_heads) with batch x g x n_rep x seq x head_dim <= max_elements; else one kv head at a time
    with the most query heads r (a divisor of n_rep) that fit."""
    n_rep = n_heads // n_kv_heads
    per_head = batch * seq * head_dim
    if per_head > max_elements:
        raise AttentionBackendError(
            f"one attention head of {batch} x {seq} tokens x {head_dim} is {per_head} elements, over 2^31; "
            "use fewer sequences per micro-batch")
    kv = max(g for g in range(1, n_kv_heads + 1) if n_kv_heads % g == 0 and g * n_rep * per_head <= max_elements
             ) if n_rep * per_head <= max_elements else 0
    if kv:
        return [(slice(j * n_rep, (j + kv) * n_rep), slice(j, j + kv)) for j in range(0, n_kv_heads, kv)]
    r = max(r for r in range(1, n_rep + 1) if n_rep % r == 0 and r * per_head <= max_elements)
    return [(slice(j * n_rep + i, j * n_rep + i + r), slice(j, j + 1))
            for j in range(n_kv_heads) for i in range(0, n_rep, r)]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                     max_elements: int = MAX_ELEMENTS) -> torch.Tensor:
    """q: [B, Hq, S, D], k and v: [B, Hkv, S, D] -> [B, Hq, S, D]; causal, one SDPA call per head group."""
    b, n_heads, s, d = q.shape
    groups = head_groups(b, s, d, n_heads, k.shape[1], max_elements)
    with _backend(q):
        outs = [_sdpa(q[:, qh], k[:, kh], v[:, kh], scale) for qh, kh in groups]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    except RuntimeError as e:
        if "No available kernel" not in str(e):
            raise
        raise AttentionBackendError(
            f"flash attention cannot run {tuple(q.shape)} {q.dtype} on {q.device} (needs a GPU of compute "
            "capability 8.0+ and a torch build with flash SDPA, head_dim <= 256); train in float32 or on such "
            "a GPU") from None


def _backend(q: torch.Tensor) -> contextlib.AbstractContextManager:
    """Flash only for CUDA bf16 / fp16 (never the O(S^2) math kernel); torch's choice otherwise."""
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16):
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    return contextlib.nullcontext()
