"""Causal attention, over whole rows or within the documents packed into them.

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

Without ``documents`` the call is today's single SDPA over the whole row, unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, enable_gqa: bool,
                     documents: Documents | None = None) -> torch.Tensor:
    """q: [B, Hq, S, D], k and v: [B, Hkv, S, D] -> [B, Hq, S, D], causal within each document of ``documents``
    (None: over the whole row). See [Note: document attention]."""
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    assert len(documents.spans) == q.shape[0], (len(documents.spans), q.shape)
    out: dict[tuple[int, int], torch.Tensor] = {}  # (row, start) -> [Hq, length, D]
    for length, places in documents.groups:
        def gather(t: torch.Tensor) -> torch.Tensor:
            return torch.stack([t[r, :, start:start + length] for r, start in places])

        y = F.scaled_dot_product_attention(gather(q), gather(k), gather(v), is_causal=True, scale=scale,
                                           enable_gqa=enable_gqa)
        out.update(zip(places, y.unbind(0)))
    return torch.stack([torch.cat([out[(r, start)] for start, _ in row], dim=1)
                        for r, row in enumerate(documents.spans)])
