"""Causal attention that is safe at any length, over whole rows or within the documents packed into them:
SDPA with ``is_causal=True`` and no mask, heads in groups.

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


[Note: document attention]
A packed row holds several documents end to end. With ``position_ids`` (one per token, 0 where a
document starts, +1 otherwise, as Hugging Face's packed-sequence collators write them) the engine
derives each micro-batch's ``Documents`` on the host before the step, and attention runs per
document: token t attends to the tokens of its own document up to t, never to an earlier one.

Mechanism: the documents of a micro-batch are grouped by length, and each group is one causal SDPA
call over a [documents, heads, length, head_dim] stack (gathered from the rows; the outputs are put
back in row order). Why this one:

- exact: each document sees precisely the causal attention it would get alone, by the same kernel
  (on CPU bitwise the same as running it on its own);
- fast on GPUs and long sequences: every call is ``is_causal=True`` without a mask, so SDPA keeps
  its flash backend and O(length) memory; no [S, S] mask exists (a boolean mask at 128k tokens is
  16 GiB per row, and any mask rules the flash kernel out); attention FLOPs are sum(L^2) / 2 over
  the documents, less than the row's S^2 / 2; it composes with splitting heads into groups;
- its cost is one call per distinct document length per micro-batch per layer pass, and one extra
  copy of q, k, v and the output (the gather and the put-back). A row of many short documents of
  distinct lengths is launch-bound; flash-attention's varlen kernel (``torch.nn.attention.varlen``,
  CUDA and 16-bit only, its signature changed between torch 2.10 and 2.13) would do it in one call,
  and flex attention with a block mask needs ``torch.compile`` and computes with other numerics.

Without ``documents`` the call is one SDPA over the whole row (in head groups, [Note: head groups]).


[Note: sliding window]
With a window w (``sliding_window``), query i sees keys i - w + 1 .. i, as transformers' sliding-window mask.
A sequence (or document) of at most w tokens is the plain causal call. A longer one runs in query tiles of w
tokens: tile [a, a + w) against keys [a - w + 1, a + w) with a boolean [w, 2w - 1] mask, so memory stays
O(S x w), never an [S, S] mask. Within packed documents each document is its own sequence, so the window
applies inside it; sequence tiles run the same call (the attention core sees the whole sequence). A mask rules
the flash kernel out: on CUDA in 16 bits these calls use the memory-efficient kernel.


[Note: attention sinks]
gpt-oss gives each query head a learned logit (its sink) that joins every query's softmax over the keys and is
dropped after it: p_ij = exp(s_ij) / (sum_j exp(s_ij) + exp(sink_h)), out_i = sum_j p_ij v_j. ``sink_attention``
runs it through the same SDPA calls as ``causal_attention``: one key is put before the sequence whose only
non-zero is a 1 in an extra column, where every query carries sink_h / scale, so its score is sink_h for every
query and real keys score as before (0 in that column); its value is zero. A zero query is put before the
sequence too, so ``is_causal=True`` (upper-left) lets query i see the sink and keys 0..i; that row's output is
dropped. The extra columns (``SINK_COLUMNS``: the sink's, then zeros to keep head_dim a multiple of 8 for the
fused kernels) cost one copy of q, k and v with head_dim + 8 and 8 / head_dim more attention FLOPs; the
gradient of the sink comes through the extra column of q. Windows (the sink's key always in every tile's mask),
documents (each its own sequence, with the sink) and sequence tiles (the core sees the whole sequence) run as
for ``causal_attention``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatrain.models.errors import AttentionBackendError

MAX_ELEMENTS = 2**31 - 1  # per tensor of one SDPA call


@dataclass(frozen=True)
class Documents:
    """Where the documents of a micro-batch lie: host data only (Python ints), built before the step.

    ``spans[r]``: row r's documents in order, each (start, length), covering the row exactly.
    ``groups``: (length, ((row, start), ...)) for each distinct length: one attention call each.
    """

    spans: tuple[tuple[tuple[int, int], ...], ...]
    groups: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> "Documents | None":
        """position_ids: [b, S] integer on the host, each row runs of 0, 1, 2, ... (checked by the caller).
        None when every row is one document (attention over the whole row is the same)."""
        b, s = position_ids.shape
        begins: list[list[int]] = [[] for _ in range(b)]
        for r, t in (position_ids == 0).nonzero().tolist():
            begins[r].append(t)
        if all(len(begin) == 1 for begin in begins):
            return None
        spans = []
        by_length: dict[int, list[tuple[int, int]]] = {}
        for r, begin in enumerate(begins):
            row = tuple((t, end - t) for t, end in zip(begin, begin[1:] + [s]))
            spans.append(row)
            for start, length in row:
                by_length.setdefault(length, []).append((r, start))
        return cls(tuple(spans), tuple((n, tuple(places)) for n, places in sorted(by_length.items())))

    @property
    def count(self) -> int:
        return sum(len(row) for row in self.spans)


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
                     documents: Documents | None = None, max_elements: int = MAX_ELEMENTS,
                     window: int | None = None) -> torch.Tensor:
    """q: [B, Hq, S, D], k and v: [B, Hkv, S, D] -> [B, Hq, S, D], causal within each document of ``documents``
    (None: over the whole row), each query seeing the last ``window`` positions (None: all); one SDPA call per
    head group (and per document length, per window tile).
    See [Note: document attention], [Note: head groups] and [Note: sliding window]."""
    return _per_document(q, k, v, documents, lambda q, k, v: _windowed(q, k, v, scale, max_elements, window))


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, *, scale: float,
                   documents: Documents | None = None, max_elements: int = MAX_ELEMENTS,
                   window: int | None = None) -> torch.Tensor:
    """``causal_attention`` with a learned logit per query head joining every query's softmax and dropped after
    it (sinks: [Hq]), as gpt-oss computes attention; see [Note: attention sinks]."""
    return _per_document(q, k, v, documents,
                         lambda q, k, v: _with_sink(q, k, v, sinks, scale, max_elements, window))


def _per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None,
                  attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``attend`` over whole rows (``documents`` None), or over each document's stack of tokens, put back in row
    order ([Note: document attention])."""
    if documents is None:
        return attend(q, k, v)
    assert len(documents.spans) == q.shape[0], (len(documents.spans), q.shape)
    out: dict[tuple[int, int], torch.Tensor] = {}  # (row, start) -> [Hq, length, D]
    for length, places in documents.groups:
        def gather(t: torch.Tensor) -> torch.Tensor:
            return torch.stack([t[r, :, start:start + length] for r, start in places])

        y = attend(gather(q), gather(k), gather(v))
        out.update(zip(places, y.unbind(0)))
    return torch.stack([torch.cat([out[(r, start)] for start, _ in row], dim=1)
                        for r, row in enumerate(documents.spans)])


def _windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, max_elements: int,
              window: int | None) -> torch.Tensor:
    """Causal over the whole of dim 2, within ``window`` positions ([Note: sliding window])."""
    s = q.shape[2]
    if window is None or s <= window:
        return _in_head_groups(q, k, v, scale, max_elements)
    outs = []
    for a in range(0, s, window):
        z, lo = min(a + window, s), max(0, a - window + 1)
        query = torch.arange(a, z, device=q.device)[:, None]
        key = torch.arange(lo, z, device=q.device)[None, :]
        mask = (key <= query) & (query - key < window)
        outs.append(_in_head_groups(q[:, :, a:z], k[:, :, lo:z], v[:, :, lo:z], scale, max_elements, mask))
    return torch.cat(outs, dim=2)


# The width a sink adds to each head: one column carries the sink logit, the rest keep head_dim a multiple of 8
# (the fused SDPA kernels' alignment).
SINK_COLUMNS = 8


def _with_sink(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, scale: float,
               max_elements: int, window: int | None) -> torch.Tensor:
    """Causal over the whole of dim 2 within ``window`` positions, each query's softmax joined by its head's sink
    logit ([Note: attention sinks])."""
    b, hq, s, d = q.shape
    column = (sinks.to(q.dtype) / scale).view(1, hq, 1, 1).expand(b, hq, s + 1, 1)
    q = torch.cat([F.pad(q, (0, 0, 1, 0)), column, q.new_zeros(b, hq, s + 1, SINK_COLUMNS - 1)], dim=-1)
    k = F.pad(k, (0, SINK_COLUMNS, 1, 0))
    k[:, :, 0, d] = 1.0
    v = F.pad(v, (0, SINK_COLUMNS, 1, 0))
    if window is None or s <= window:
        return _in_head_groups(q, k, v, scale, max_elements)[:, :, 1:, :d]
    outs = []
    for a in range(0, s, window):
        z, lo = min(a + window, s), max(0, a - window + 1)
        query = torch.arange(a, z, device=q.device)[:, None]
        key = torch.arange(lo, z, device=q.device)[None, :]
        mask = torch.cat([torch.ones_like(query, dtype=torch.bool), (key <= query) & (query - key < window)], dim=1)
        keys = [torch.cat([t[:, :, :1], t[:, :, 1 + lo:1 + z]], dim=2) for t in (k, v)]
        outs.append(_in_head_groups(q[:, :, 1 + a:1 + z], *keys, scale, max_elements, mask)[..., :d])
    return torch.cat(outs, dim=2)


def _in_head_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    max_elements: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal over the whole of dim 2 (or as ``mask`` [Sq, Sk] allows), one SDPA call per head group."""
    b, n_heads, s, d = q.shape
    groups = head_groups(b, max(s, k.shape[2]), d, n_heads, k.shape[1], max_elements)
    with _backend(q, mask is not None):
        outs = [_sdpa(q[:, qh], k[:, kh], v[:, kh], scale, mask) for qh, kh in groups]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
          mask: torch.Tensor | None = None) -> torch.Tensor:
    try:
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                  enable_gqa=q.shape[1] != k.shape[1])
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    except RuntimeError as e:
        if "No available kernel" not in str(e):
            raise
        raise AttentionBackendError(
            f"flash attention cannot run {tuple(q.shape)} {q.dtype} on {q.device} (needs a GPU of compute "
            "capability 8.0+ and a torch build with flash SDPA, head_dim <= 256); train in float32 or on such "
            "a GPU") from None


def _backend(q: torch.Tensor, masked: bool = False) -> contextlib.AbstractContextManager:
    """Flash only for CUDA bf16 / fp16 (never the O(S^2) math kernel; the memory-efficient one for a window's
    masked tiles); torch's choice otherwise."""
    if q.device.type == "cuda" and q.dtype in (torch.bfloat16, torch.float16):
        return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION if masked else SDPBackend.FLASH_ATTENTION])
    return contextlib.nullcontext()
