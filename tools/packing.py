"""Sequence packing: documents into fixed-length training rows, boundaries marked, nothing lost.

[Note: packing]
Three ways to make rows of ``seq_len`` tokens (``--packing``):

``concat``: the documents are laid end to end, each followed by the separator (an end-of-text token),

    doc0 SEP doc1 SEP doc2 SEP ...

and the stream is cut into rows. Every token of every document appears exactly once, in order;
wherever a row holds the end of one document and the start of the next, a separator stands between
them, so the model learns where a document ends (it predicts SEP) and that what follows SEP is
unrelated; but it attends across the separator to the earlier documents of its row. A long
document continues into the next row.

``documents``: the same rows, with each row's position ids (0 where a document starts, +1 per
token), which the engine uses to restart RoPE positions and keep attention within each document
(models/layers/attention.py). A document is its tokens and its separator. The first token of each
document is labelled -100: the token before it ends another document and cannot predict it. So a
row's loss is the token-weighted mean of its documents' losses run one by one. A document split
across rows continues at position 0 of the next row as its own segment, as Hugging Face's
packed-sequence collators do (``DataCollatorWithFlattening``): the continuation does not see the
part in the previous row, and its first token is not predicted (as at every row start).

``none``: one document per row: the document and its separator, truncated to ``seq_len`` (the
rest of a longer document is dropped) and padded.

``whole``: documents apart as in ``documents``, but each in one row whole, rows filled best-fit-decreasing
(bin_packing.py, [Note: whole-document packing]); only a document longer than a row is split.

Every mode reports, row by row (``RowFigures``), its padding, the documents it begins, the documents it
cuts (a document, with its separator, not held whole by one row: continued in the next row, truncated by
``none``, or split by ``whole``) and the documents it ends (whose last token, or separator, is in it: trained
once the row is); ``PackingStats`` adds them up for the run's summary, with the documents dropped before
packing because they have nothing to learn (``learnable``: a chat record with no labelled token, or, where each
document starts a row (``whole``, ``none``), none in its first row: a prompt that fills the row alone). A batch
of such rows would have no token to predict.

In every mode only padding is filler: it carries ``pad_id`` and the label -100 (ignored by the loss);
packed modes pad only the final row (in ``documents``, the padding is a segment of its own). Labels are
otherwise the input ids: the engine shifts them inside, as Hugging Face does.

A document may also come as a pair (ids, labels) of equal length (chat data: -100 on the prompt's
tokens, see [Note: chat data] in tools/chat_data.py). Its labels travel with its tokens, and the
separator after it is labelled like the document's last token: trained after an answer, ignored
after a prompt.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator, Mapping, NamedTuple

import numpy as np
import torch

from . import bin_packing

IGNORE_INDEX = -100
MODES = ("documents", "concat", "none", "whole")

Document = np.ndarray | tuple[np.ndarray, np.ndarray]


class Row(NamedTuple):
    ids: np.ndarray                 # [seq_len] int64
    labels: np.ndarray              # [seq_len] int64, -100 where nothing is learned
    positions: np.ndarray | None    # [seq_len] int64 position within its document ("documents"), else None


class Batch(NamedTuple):
    input_ids: torch.Tensor               # [batch, seq_len] torch.long
    labels: torch.Tensor                  # [batch, seq_len] torch.long
    position_ids: torch.Tensor | None     # [batch, seq_len] torch.long ("documents"), else None


@dataclass
class RowFigures:
    """The row just yielded by ``pack``: positions of padding (the row's last ones), documents begun in it,
    documents cut in it, documents ended in it."""

    padding: int = 0
    documents: int = 0
    cut: int = 0
    ended: int = 0


@dataclass
class PackingStats:
    """The rows counted so far (``add``): what the summary reports for every packing mode."""

    rows: int = 0
    positions: int = 0
    padding: int = 0
    documents: int = 0
    cut: int = 0
    dropped: int = 0   # documents with nothing to learn, never packed (``learnable``)

    def add(self, row: RowFigures, seq_len: int) -> None:
        self.rows += 1
        self.positions += seq_len
        self.padding += row.padding
        self.documents += row.documents
        self.cut += row.cut

    @property
    def padding_fraction(self) -> float:
        return self.padding / self.positions if self.positions else 0.0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any] | None) -> "PackingStats":
        return cls(**{k: int(v) for k, v in (saved or {}).items() if k in cls.__dataclass_fields__})


def learnable(doc: Document, seq_len: int, mode: str) -> bool:
    """Whether ``doc`` gives its rows a token to predict. Plain text always does (its labels are its tokens); an
    (ids, labels) pair needs a labelled token, and in ``whole`` and ``none`` (where it starts a row, its first
    token unpredicted) one within its first row: a prompt longer than the row leaves that row nothing to learn,
    and the completion would be learnt without seeing its prompt."""
    if not isinstance(doc, tuple):
        return True
    labels = doc[1]
    if mode in ("whole", "none"):
        labels = labels[1:seq_len]
    return bool((labels != IGNORE_INDEX).any())


def pack(documents: Iterable[Document], seq_len: int, separator_id: int, pad_id: int | None = None,
         mode: str = "concat", figures: RowFigures | None = None) -> Iterator[Row]:
    """Rows from ``documents`` (1-D integer arrays, or (ids, labels) pairs). See [Note: packing].

    ``figures``, when given, holds the figures of the row just yielded. Documents may be memory-mapped: in
    the modes that cut rows, each is sliced a row at a time, never copied whole.
    """
    assert seq_len >= 1 and mode in MODES, (seq_len, mode)
    pad = separator_id if pad_id is None else pad_id
    figures = RowFigures() if figures is None else figures
    if mode == "none":
        for doc in documents:
            size = len(doc[0] if isinstance(doc, tuple) else doc) + 1  # with its separator
            figures.padding, figures.documents, figures.cut = max(0, seq_len - size), 1, int(size > seq_len)
            figures.ended = 1
            yield _one_row(doc, seq_len, separator_id, pad)
        return
    if mode == "whole":
        for packed in bin_packing.pack_whole(_with_separator(documents, separator_id), seq_len, pad):
            figures.padding, figures.documents, figures.cut = packed.padding, packed.documents, packed.cut
            figures.ended = packed.ended
            yield Row(packed.ids, packed.labels, packed.positions)
        return
    sep = np.array([separator_id], dtype=np.int64)
    with_positions = mode == "documents"
    pieces: list[np.ndarray] = []   # the row being filled
    label_pieces: list[np.ndarray] = []  # their labels
    position_pieces: list[np.ndarray] = []  # their positions ("documents")
    have = 0                        # tokens in pieces
    begun = cut = ended = 0         # documents begun in the row being filled; documents it cuts; it ends
    for doc in documents:
        doc, doc_labels, sep_labels = _parts(doc, sep)
        at, first = 0, True  # the next token's position in its segment of this row; the document's first token
        begun += 1
        counted = False  # this document counted as cut
        for part, part_labels in ((doc, doc_labels), (sep, sep_labels)):
            pos, n = 0, len(part)
            while pos < n:
                take = min(seq_len - have, n - pos)
                pieces.append(np.asarray(part[pos:pos + take], dtype=np.int64))
                labels = np.asarray(part_labels[pos:pos + take], dtype=np.int64)
                if with_positions:
                    if have == 0:
                        at = 0  # a row starts a segment: the document's continuation restarts at 0
                    if first:  # nothing of the document stands before its first token to predict it
                        labels = labels.copy()  # (else a view of the document's own array)
                        labels[0] = IGNORE_INDEX
                    position_pieces.append(np.arange(at, at + take, dtype=np.int64))
                    at += take
                first = False
                label_pieces.append(labels)
                pos += take
                have += take
                if part is sep and pos == n:  # the separator placed: the document ends in this row
                    ended += 1
                if have == seq_len:
                    if (pos < n or part is doc) and not counted:  # the document goes on in the next row
                        cut, counted = cut + 1, True
                    figures.padding, figures.documents, figures.cut, figures.ended = 0, begun, cut, ended
                    yield Row(np.concatenate(pieces), np.concatenate(label_pieces),
                              np.concatenate(position_pieces) if with_positions else None)
                    pieces, label_pieces, position_pieces, have, begun, cut, ended = [], [], [], 0, 0, 0, 0
    if have:
        ids = np.full(seq_len, pad, dtype=np.int64)
        labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
        ids[:have] = np.concatenate(pieces)
        labels[:have] = np.concatenate(label_pieces)
        positions = None
        if with_positions:  # the padding: a segment of its own
            positions = np.concatenate(position_pieces + [np.arange(seq_len - have, dtype=np.int64)])
        figures.padding, figures.documents, figures.cut, figures.ended = seq_len - have, begun, cut, ended
        yield Row(ids, labels, positions)


def _with_separator(documents: Iterable[Document], separator_id: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, labels) of each document with its separator appended and labelled (``_parts``'s rule)."""
    sep = np.array([separator_id], dtype=np.int64)
    for doc in documents:
        ids, labels, sep_labels = _parts(doc, sep)
        yield (np.concatenate([np.asarray(ids, dtype=np.int64), sep]),
               np.concatenate([np.asarray(labels, dtype=np.int64), np.asarray(sep_labels, dtype=np.int64)]))


def _parts(doc: Document, sep: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, labels, the separator's label) of a document: a chat pair's separator is labelled like its last token."""
    if isinstance(doc, tuple):
        ids, labels = doc
        trained = len(labels) and labels[-1] != IGNORE_INDEX
        return ids, labels, sep if trained else np.array([IGNORE_INDEX], dtype=np.int64)
    return doc, doc, sep


def _one_row(doc: Document, seq_len: int, separator_id: int, pad: int) -> Row:
    """``--packing none``: the document and its separator, truncated to seq_len, padded."""
    sep = np.array([separator_id], dtype=np.int64)
    ids, labels, sep_labels = _parts(doc, sep)
    take = min(len(ids), seq_len)
    row = np.full(seq_len, pad, dtype=np.int64)
    row_labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    row[:take] = np.asarray(ids[:take], dtype=np.int64)
    row_labels[:take] = np.asarray(labels[:take], dtype=np.int64)
    if take < seq_len:
        row[take], row_labels[take] = separator_id, sep_labels[0]
    return Row(row, row_labels, None)


def resolve_mode(mode: str, first: Document | None) -> str:
    """``auto``: ``whole`` when the data is chat records (its first document decides), ``concat`` for
    plain text (see the README's packing paragraph for why)."""
    if mode != "auto":
        return mode
    return "whole" if isinstance(first, tuple) else "concat"


def repeat_epochs(corpus_pass, max_epochs: int | None = None) -> Iterator[Document]:
    """Documents of ``corpus_pass()`` again and again (each call is one pass over the corpus)."""
    epoch = 0
    while max_epochs is None or epoch < max_epochs:
        empty = True
        for doc in corpus_pass():
            if len(doc[0] if isinstance(doc, tuple) else doc):
                empty = False
                yield doc
        if empty:
            return
        epoch += 1


def batches(rows: Iterator[Row], batch: int, skip_rows: int = 0) -> Iterator[Batch]:
    """Batches of ``batch`` rows, after skipping ``skip_rows`` rows (resume).

    A final incomplete batch is dropped.
    """
    for _ in range(skip_rows):
        if next(rows, None) is None:
            return
    while True:
        group = [r for _, r in zip(range(batch), rows)]
        if len(group) < batch:
            return
        ids = torch.from_numpy(np.stack([g.ids for g in group]))
        labels = torch.from_numpy(np.stack([g.labels for g in group]))
        positions = None if group[0].positions is None else torch.from_numpy(np.stack([g.positions for g in group]))
        yield Batch(ids, labels, positions)
