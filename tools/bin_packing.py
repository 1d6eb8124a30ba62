"""Whole-document packing: best-fit-decreasing bin packing of documents into rows (``--packing whole``).

[Note: whole-document packing]
A document (its tokens and its separator, labelled as in [Note: packing] of packing.py) goes into one row
whole, starting at position 0 of its own segment: every answer is trained and evaluated with its whole
prompt in view, and a row's loss is exactly the token-weighted mean of its documents scored one by one.

Rows are filled best-fit-decreasing (TRL's ``bfd`` strategy, torchtune's packed datasets): the documents
of a window are taken longest first (ties: the earlier document first), and each goes into the open row
with the least room that still holds it, or starts a new row. The rows of a window come out ordered by
their earliest document, so the epoch's shuffle still decides what is trained first; each row lists its
documents in their order, and its room left is padding (pad id, label -100, a segment of its own).

A window is the documents read until they hold ``WINDOW_ROWS`` rows' worth of tokens (the last window of an
epoch: what is left), so memory stays bounded on any corpus and the rows depend only on the documents and
their order: the same seed gives the same rows, and a resumed run packs its epoch again and skips the rows
already trained, as for the other modes.

A document longer than a row (with its separator) is split, the stated rule: into pieces of ``seq_len``
tokens from its start, the last piece holding the rest; each piece is packed as a document of its own
(positions restart at 0 and its first token is not predicted, as a row start in ``documents`` mode), and the
document is counted as cut.
"""
from __future__ import annotations

import bisect
from typing import Iterable, Iterator, NamedTuple

import numpy as np

# Tokens of documents gathered before a window is packed, in rows: bounds the window's memory to
# WINDOW_ROWS x seq_len x 16 bytes (ids and labels, int64), 64 MiB at seq_len 16384.
WINDOW_ROWS = 256
IGNORE_INDEX = -100


class Piece(NamedTuple):
    """What goes into a row whole: a document (or a split document's piece) with its separator."""

    ids: np.ndarray      # [n] int64, n <= seq_len
    labels: np.ndarray   # [n] int64, the first -100
    begins: bool         # the document's first piece (its only one unless it was split)
    cut: bool            # the first piece of a document that was split
    ends: bool           # the document's last piece (its only one unless it was split)


class PackedRow(NamedTuple):
    ids: np.ndarray        # [seq_len] int64
    labels: np.ndarray     # [seq_len] int64
    positions: np.ndarray  # [seq_len] int64: 0 at each piece's start and at the padding's
    padding: int           # positions holding no document
    documents: int         # documents begun in the row (a split document's later pieces not counted)
    cut: int               # documents split whose first piece is here
    ended: int             # documents whose last piece is here (a split document's earlier pieces not counted)


def pieces(ids: np.ndarray, labels: np.ndarray, seq_len: int) -> list[Piece]:
    """A document's pieces (ids and labels with the separator already appended): itself, or split."""
    out = []
    for start in range(0, len(ids), seq_len):
        part = np.array(labels[start:start + seq_len], dtype=np.int64)
        part[0] = IGNORE_INDEX  # nothing of this document stands before it in its row
        out.append(Piece(np.asarray(ids[start:start + seq_len], dtype=np.int64), part, start == 0,
                         start == 0 and len(ids) > seq_len, start + seq_len >= len(ids)))
    return out


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of item numbers (each ascending), every item in one bin, no bin over ``capacity``; ordered by
    their first item. Longest first (ties: lower number); each into the fullest bin that still holds it."""
    assert all(0 < n <= capacity for n in lengths), (lengths, capacity)
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, bin number) of the bins with room, ascending
    for item in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        size = lengths[item]
        at = bisect.bisect_left(room, (size, -1))
        if at == len(room):
            bins.append([item])
            left, number = capacity - size, len(bins) - 1
        else:
            left, number = room.pop(at)
            bins[number].append(item)
            left -= size
        if left > 0:
            bisect.insort(room, (left, number))
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def pack_whole(documents: Iterable[tuple[np.ndarray, np.ndarray]], seq_len: int, pad: int) -> Iterator[PackedRow]:
    """Rows of whole documents from (ids, labels) pairs that include their separator. See the note above."""
    window: list[Piece] = []
    tokens = 0
    for ids, labels in documents:
        for piece in pieces(ids, labels, seq_len):
            window.append(piece)
            tokens += len(piece.ids)
        if tokens >= WINDOW_ROWS * seq_len:
            yield from _rows(window, seq_len, pad)
            window, tokens = [], 0
    yield from _rows(window, seq_len, pad)


def _rows(window: list[Piece], seq_len: int, pad: int) -> Iterator[PackedRow]:
    for items in best_fit_decreasing([len(p.ids) for p in window], seq_len):
        chosen = [window[i] for i in items]
        used = sum(len(p.ids) for p in chosen)
        ids = np.full(seq_len, pad, dtype=np.int64)
        labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
        ids[:used] = np.concatenate([p.ids for p in chosen])
        labels[:used] = np.concatenate([p.labels for p in chosen])
        positions = np.concatenate([np.arange(len(p.ids), dtype=np.int64) for p in chosen]
                                   + [np.arange(seq_len - used, dtype=np.int64)])
        yield PackedRow(ids, labels, positions, seq_len - used, sum(p.begins for p in chosen),
                        sum(p.cut for p in chosen), sum(p.ends for p in chosen))
