"""The order a run trains in: the held-out split, a seeded shuffle of the documents every epoch, and the data
position a checkpoint keeps, so that a resumed run trains on exactly the batches an uninterrupted one would.

[Note: data order]
The unit of order is the document (a .jsonl line, a parquet row, a text file, a 2-D .npy row: see
[Note: document addresses] in data.py), not the packed row. Epoch e trains on the training documents in
the order ``epoch_order(e)``, packed into rows (packing.py) from the first document of the epoch: an
epoch's rows are its own, and the last one may be padded. Documents rather than rows, because a
document's neighbours in a row then change every epoch, and because the rows of a tokenized-on-the-fly
corpus have no address until the corpus has been tokenized once, which shuffling documents never needs.
Corpora can be large and memory-mapped: what is shuffled is document numbers (8 bytes each), never tokens.

The shuffle is an argsort of a hash of (seed, epoch, document number): splitmix64 in integer arithmetic,
so the order depends on the seed and the document count alone, on every machine and numpy version, and
``--no-shuffle`` trains in corpus order. The held-out split (``--eval-fraction``) takes the documents with
the smallest hashes of (seed, document number) under another stream: a fixed set for the seed, never
trained on, whatever the shuffle.

The data position (``Position``) after each step is (epoch, rows of that epoch trained, rows in all);
a checkpoint keeps it with the document count and the order's name. A resumed run packs its epoch again
from the epoch's first document and skips the rows already trained (tokenizing them again: at most one
epoch of reading, never the epochs before), then goes on: the same rows, batched the same way.
"""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from . import packing
from .data import Addresses, Corpus
from .train_config import TrainConfig, TrainConfigError

ORDER_SHUFFLED = "splitmix64-argsort-v1"   # a checkpoint names the order its position counts in
ORDER_IN_CORPUS = "corpus"
_EVAL_STREAM, _EPOCH_STREAM = 1, 2
_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(z: Any) -> Any:
    """splitmix64's finalizer, on a Python int (masked) or a uint64 array (wrapping)."""
    if isinstance(z, int):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def hash_keys(count: int, *stream: int) -> np.ndarray:
    """A pseudo-random uint64 for each of 0..count-1, a function of ``stream`` (seed, purpose, ...) alone."""
    base = 0
    for part in stream:
        base = _mix((base + (part & _MASK) * _GOLDEN + _GOLDEN) & _MASK)
    i = np.arange(1, count + 1, dtype=np.uint64)
    return _mix(np.uint64(base) + i * np.uint64(_GOLDEN))


def split(count: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) document numbers, each ascending: ``round(eval_fraction * count)`` held out (at
    least one when the fraction is not 0), chosen by the seed. One line when either side would be empty."""
    numbers = np.arange(count, dtype=np.int64)
    if eval_fraction <= 0:
        return numbers, numbers[:0]
    held = max(1, round(eval_fraction * count))
    if held >= count:
        raise TrainConfigError(f"eval_fraction: {eval_fraction:g} of {count} document(s) leaves none to train on; "
                               f"lower --eval-fraction, or give more documents or a separate --eval-data")
    chosen = np.zeros(count, dtype=bool)
    chosen[np.argsort(hash_keys(count, seed, _EVAL_STREAM), kind="stable")[:held]] = True
    return numbers[~chosen], numbers[chosen]


def epoch_order(numbers: np.ndarray, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The document numbers of epoch ``epoch``: ``numbers`` shuffled by (seed, epoch), or as they are."""
    if not shuffle:
        return numbers
    return numbers[np.argsort(hash_keys(len(numbers), seed, _EPOCH_STREAM, epoch), kind="stable")]


@dataclass(frozen=True)
class Position:
    """Where the data stands after a step (see [Note: data order])."""

    epoch: int = 0        # the epoch of the next row (0-based)
    epoch_rows: int = 0   # rows of that epoch already trained
    rows_done: int = 0    # rows trained in all

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class TrainingData:
    """The training batches from a position on; ``position``, ``epoch`` and ``padding`` follow the last batch given out.

    ``epoch`` is a number people read: the epochs done, with the fraction of this epoch's documents the rows
    given out so far end (1.5: halfway through the second pass). A document counts once the row holding its last
    token (its separator) is given out, so a packing window read ahead counts nothing; a document with no
    token counts when it is read. At a resume the epoch's rows are packed again, so the count is the same.
    """

    def __init__(self, corpus: Corpus, addresses: Addresses, numbers: np.ndarray, seq_len: int, batch: int,
                 separator_id: int, seed: int, shuffle: bool, position: Position = Position(),
                 mode: str = "concat", position_stats: Mapping[str, Any] | None = None) -> None:
        self.corpus, self.addresses, self.numbers = corpus, addresses, numbers
        self.seq_len, self.batch, self.separator_id = seq_len, batch, separator_id
        self.seed, self.shuffle = seed, shuffle
        self.position = position
        self.mode = mode  # packing.MODES: how documents become rows
        self.epoch = float(position.epoch)
        self._empty = 0  # documents of the current epoch read and never packed (no token, or nothing to learn)
        # the padding (a row's last positions) of the last ``batch`` rows given out, newest last
        self._rows_padding: deque[int] = deque(maxlen=batch)
        self._started = 0  # documents of the current epoch handed to packing
        self._dropped = 0  # of those, the ones with nothing to learn (packing.learnable)
        self._counting = True  # dropped documents are counted (not those before a resumed position)
        # The rows given out, in all (a checkpoint keeps them): padding and cut documents for the summary.
        self.packed = packing.PackingStats.from_dict(position_stats)

    def describe(self) -> str:
        order = f"shuffled by seed {self.seed} each epoch" if self.shuffle else "in corpus order"
        return f"{self.corpus.describe()} ({len(self.numbers):,} training documents, {order})"

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the position, the document count and the order it counts in."""
        return {**self.position.to_dict(), "documents": len(self.numbers),
                "order": ORDER_SHUFFLED if self.shuffle else ORDER_IN_CORPUS, "packed": self.packed.to_dict()}

    @staticmethod
    def resumed_position(saved: Mapping[str, Any], documents: int) -> Position:
        """The position a checkpoint kept (``state()``), checked against the training documents there are now."""
        if int(saved["documents"]) != documents:
            raise TrainConfigError(f"data: the training data now holds {documents} document(s), the resumed run's "
                                   f"held {saved['documents']}; resume with the data it trained on, or start a new "
                                   f"run with --out")
        return Position(int(saved["epoch"]), int(saved["epoch_rows"]), int(saved["rows_done"]))

    def batches(self) -> Iterator[packing.Batch]:
        return packing.batches(self._rows(), self.batch)

    def padding(self) -> torch.Tensor:
        """[batch, seq_len] bool, True at the padding positions of the last batch given out."""
        rows = list(self._rows_padding)
        assert len(rows) == self.batch, "padding() is asked before a batch was given out"
        return torch.arange(self.seq_len).unsqueeze(0) >= torch.tensor([self.seq_len - n for n in rows]).unsqueeze(1)

    def _rows(self) -> Iterator[packing.Row]:
        epoch, skip = self.position.epoch, self.position.epoch_rows
        while True:
            self._empty = 0
            self._started = self._dropped = 0
            self._counting = skip == 0  # a resumed epoch's rows before its position were counted already
            order = epoch_order(self.numbers, self.seed, epoch, self.shuffle)
            rows = ended = 0  # rows of the epoch packed, documents they end (the skipped ones too: exact at resume)
            figures = packing.RowFigures()
            for row in packing.pack(self._documents(order), self.seq_len, self.separator_id, mode=self.mode,
                                    figures=figures):
                rows += 1
                ended += figures.ended
                self._counting = rows >= skip
                if rows <= skip:
                    continue
                self.packed.add(figures, self.seq_len)
                self.position = Position(epoch, rows, self.position.rows_done + 1)
                self.epoch = epoch + (ended + self._empty) / max(1, len(order))
                self._rows_padding.append(figures.padding)
                yield row
            if rows == 0 and self._dropped:
                raise TrainConfigError(f"data: none of the {self._started:,} training documents has a token to "
                                       f"learn (a chat record needs an assistant turn, and with --packing "
                                       f"{self.mode} one within its first {self.seq_len} tokens); raise --seq-len, "
                                       f"shorten the prompts, or check the data")
            if rows == 0:
                return  # no tokens at all: the caller says so
            epoch, skip = epoch + 1, 0

    def _documents(self, order: np.ndarray) -> Iterator[np.ndarray | tuple[np.ndarray, np.ndarray]]:
        file, where = self.addresses.file, self.addresses.where
        for number in order:
            doc = self.corpus.document(int(file[number]), int(where[number]))
            self._started += 1
            if not packing.learnable(doc, self.seq_len, self.mode):  # counted, as cut documents are; never packed
                self._dropped += 1
                self._empty += 1
                self.packed.dropped += int(self._counting)
            elif len(doc[0] if isinstance(doc, tuple) else doc):
                yield doc
            else:
                self._empty += 1


def packing_mode(requested: str, corpus: Corpus) -> str:
    """--packing, with auto decided by the data's first document (chat record: whole; text: concat)."""
    documents = corpus.documents()
    mode = packing.resolve_mode(requested, next(documents, None))
    documents.close()
    streams = [f for f in corpus.files if f.endswith(".bin") or f.endswith(".npy") and _is_1d_npy(f)]
    if mode == "none" and streams:
        raise TrainConfigError(f"packing: none makes one row of each document, and {streams[0]} is one document "
                               f"(a single token stream): it would train on its first seq_len tokens only; use "
                               f"--packing concat or documents")
    if mode == "whole" and streams:
        raise TrainConfigError(f"packing: whole keeps each document in one row, and {streams[0]} is one document "
                               f"(a single token stream) that it would split into rows held in memory; use "
                               f"--packing concat or documents")
    return mode


def _is_1d_npy(path: str) -> bool:
    """A pre-tokenized .npy of one dimension is one document (checked readable by Corpus.check_token_ids)."""
    return np.load(path, mmap_mode="r", allow_pickle=False).ndim == 1


def training_data(config: TrainConfig, corpus: Corpus, separator_id: int, saved: Mapping[str, Any] | None = None,
                  rows_done: int = 0, mode: str = "concat") -> tuple[TrainingData, np.ndarray]:
    """The run's training data from its position (``saved``: a checkpoint's ``state()``), and the held-out
    document numbers. A checkpoint from before the position was kept gives only ``rows_done`` (corpus order)."""
    addresses = corpus.addresses()
    numbers, held_out = split(len(addresses), config.eval_fraction, config.seed)
    position = (TrainingData.resumed_position(saved, len(numbers)) if saved
                else Position(0, rows_done, rows_done))
    return TrainingData(corpus, addresses, numbers, config.seq_len, config.batch, separator_id, config.seed,
                        config.shuffle, position, mode, (saved or {}).get("packed")), held_out
