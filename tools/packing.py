"""Sequence packing: documents into fixed-length training rows, boundaries marked, nothing lost.

[Note: packing]
The documents are laid end to end, each followed by the separator (an end-of-text token):

    doc0 SEP doc1 SEP doc2 SEP ...

and the stream is cut into rows of ``seq_len`` tokens. Every token of every document appears
exactly once, in order; wherever a row holds the end of one document and the start of the next,
a separator stands between them, so the model learns where a document ends (it predicts SEP) and
that what follows SEP is unrelated. A long document continues into the next row. Only the final
row can be short: it is filled with ``pad_id`` and its padding carries the label -100 (ignored by
the loss). Labels are otherwise the input ids: the engine shifts them inside, as Hugging Face does.

A document may also come as a pair (ids, labels) of equal length (chat data: -100 on the prompt's
tokens, see [Note: chat data] in tools/chat_data.py). Its labels travel with its tokens, and the
separator after it is labelled like the document's last token: trained after an answer, ignored
after a prompt.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import torch

IGNORE_INDEX = -100


def pack(documents: Iterable[np.ndarray | tuple[np.ndarray, np.ndarray]], seq_len: int, separator_id: int,
         pad_id: int | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Rows (ids, labels), each [seq_len] int64, from ``documents`` (1-D integer arrays, or (ids, labels) pairs).

    See [Note: packing].

    Documents may be memory-mapped: each is sliced a row at a time, never copied whole.
    """
    assert seq_len >= 1
    pad = separator_id if pad_id is None else pad_id
    sep = np.array([separator_id], dtype=np.int64)
    pieces: list[np.ndarray] = []   # the row being filled
    have = 0                        # tokens in pieces
    label_pieces: list[np.ndarray] = []  # their labels
    for doc in documents:
        if isinstance(doc, tuple):
            doc, doc_labels = doc
            sep_labels = sep if len(doc_labels) and doc_labels[-1] != IGNORE_INDEX else np.array([IGNORE_INDEX])
        else:
            doc_labels, sep_labels = doc, sep
        for part, part_labels in ((doc, doc_labels), (sep, sep_labels)):
            pos, n = 0, len(part)
            while pos < n:
                take = min(seq_len - have, n - pos)
                pieces.append(np.asarray(part[pos:pos + take], dtype=np.int64))
                label_pieces.append(np.asarray(part_labels[pos:pos + take], dtype=np.int64))
                pos += take
                have += take
                if have == seq_len:
                    yield np.concatenate(pieces), np.concatenate(label_pieces)
                    pieces, label_pieces, have = [], [], 0
    if have:
        ids = np.full(seq_len, pad, dtype=np.int64)
        labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
        ids[:have] = np.concatenate(pieces)
        labels[:have] = np.concatenate(label_pieces)
        yield ids, labels


def repeat_epochs(corpus_pass, max_epochs: int | None = None) -> Iterator[np.ndarray]:
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


def batches(rows: Iterator[tuple[np.ndarray, np.ndarray]], batch: int,
            skip_rows: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids, labels), each [batch, seq_len] torch.long, after skipping ``skip_rows`` rows (resume).

    A final incomplete batch is dropped.
    """
    for _ in range(skip_rows):
        if next(rows, None) is None:
            return
    while True:
        group = [r for _, r in zip(range(batch), rows)]
        if len(group) < batch:
            return
        ids = torch.from_numpy(np.stack([g[0] for g in group]))
        labels = torch.from_numpy(np.stack([g[1] for g in group]))
        yield ids, labels
