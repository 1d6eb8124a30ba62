"""Training data: where documents come from, as arrays of token ids.

A ``Corpus`` yields documents in a fixed order (``documents()``), and reads any one by its address
(``addresses()``, ``document(file, where)``; [Note: document addresses]): the order a run trains in is
data_order.py's. Sources, by file extension:

    .txt .md .text .rst (or any other file named explicitly)   one document per file
    .jsonl                                                     one document per line (``text_field``)
    .parquet                                                   one document per row (needs pyarrow)
    .npy                                                       pre-tokenized: 1-D = one document, 2-D = one per row
    .bin                                                       pre-tokenized raw ids (``token_dtype``), one document

A .jsonl line or parquet row without ``text_field`` but with ``messages`` or ``prompt`` and ``completion``
is a chat record: rendered and labelled by ``chat_data.ChatFormat`` (an (ids, labels) pair, the prompt's
labels -100 unless ``train_on="all"``; see [Note: chat data]).

Text is tokenized as it is read (nothing is held in memory but the current document);
.npy and .bin files are memory-mapped.

[Note: document addresses]
Shuffling needs any document by number without holding the corpus: ``addresses()`` makes one pass that
reads no text and tokenizes nothing (file sizes, .npy headers, parquet metadata, and the offsets of a .jsonl
file's non-blank lines, found at disk speed) and keeps 12 bytes per document (file number, place in it).
``document`` reads one back: a .jsonl line by seeking to it, a .npy row or .bin file through its memory
map, a parquet row through the row group that holds it (cached: reading in order decodes each group once,
reading shuffled decodes a group per document, so shuffle large parquet files as .jsonl, or write them with
small row groups). A text file, a 1-D .npy and a .bin file are one document each.
"""
from __future__ import annotations

import json
import os
from typing import Iterator, NamedTuple

import numpy as np

from . import chat_data
from .tokenizer import Tokenizer
from .train_config import TrainConfigError

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
# Token ids checked per piece of a pre-tokenized file (bounds the memory of the check: 8 MiB of int64).
ID_CHECK_PIECE = 1 << 20
DATA_SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet", ".npy", ".bin")
# Bytes read at a time when finding the lines of a .jsonl file.
LINE_SCAN_PIECE = 1 << 24


def demo_documents() -> list[str]:
    """The standard library's pydoc topics: ~0.5 MB of English and Python, in every installation."""
    from pydoc_data import topics

    return [topics.topics[k] for k in sorted(topics.topics)]


class Corpus:
    """The documents of ``paths`` (files or directories), tokenized by ``tokenizer``.

    ``paths`` empty: the demo corpus (pydoc topics).
    """

    def __init__(self, paths: tuple[str, ...], tokenizer: Tokenizer, text_field: str = "text",
                 token_dtype: str = "uint16", train_on: str = "completion") -> None:
        self.tokenizer = tokenizer
        self.train_on = train_on
        self._chat: chat_data.ChatFormat | None = None  # made at the first chat record
        self.text_field = text_field
        self.token_dtype = np.dtype(token_dtype)
        self.files = expand(paths)
        self._mapped: dict[str, np.ndarray] = {}  # memory-mapped .npy / .bin files, opened once
        self._row_group: tuple[str, int, list[dict]] | None = None  # parquet: (file, first row, rows)
        self._demo_texts: list[str] | None = None
        if paths and not self.files:
            raise TrainConfigError(f"data: no {', '.join(DATA_SUFFIXES)} files in {', '.join(paths)}")
        for f in self.files:
            if f.endswith(".parquet"):
                _require_pyarrow(f)

    def check_token_ids(self, vocab_size: int) -> None:
        """Pre-tokenized files (.npy, .bin) hold ids in [0, vocab_size): checked before the first step, in pieces.

        Text is tokenized by a tokenizer whose ids the model covers (checked where the model is chosen).
        """
        for path in self.files:
            if not path.endswith((".npy", ".bin")):
                continue
            for array in self._read(path) if path.endswith(".bin") else _whole_npy(path):
                flat = array.reshape(-1)
                for lo in range(0, len(flat), ID_CHECK_PIECE):
                    piece = np.asarray(flat[lo:lo + ID_CHECK_PIECE])
                    if not len(piece):
                        continue
                    low, high = int(piece.min()), int(piece.max())
                    if low < 0 or high >= vocab_size:
                        bad = low if low < 0 else high
                        raise TrainConfigError(f"data: {path} holds token id {bad}, outside the model's vocabulary "
                                               f"(ids 0..{vocab_size - 1}); tokenize it with the model's tokenizer")

    def describe(self) -> str:
        if not self.files:
            return "Python's pydoc topics (demo corpus)"
        return self.files[0] if len(self.files) == 1 else f"{len(self.files)} files ({self.files[0]}, ...)"

    def documents(self) -> Iterator[np.ndarray | tuple[np.ndarray, np.ndarray]]:
        """One pass over the corpus: each document as a 1-D integer array, a chat record as (ids, labels)."""
        if not self.files:
            for text in demo_documents():
                yield self._encode(text)
            return
        for path in self.files:
            yield from self._read(path)

    # ------------------------------------------------------------------ random access: [Note: document addresses]
    def addresses(self) -> "Addresses":
        """Every document's address, in the order ``documents()`` yields them (empty ones included)."""
        files, where = [], []
        if not self.files:
            n = len(self._demo())
            return Addresses(np.full(n, -1, dtype=np.int32), np.arange(n, dtype=np.int64))
        for number, path in enumerate(self.files):
            found = self._locate(path)
            files.append(np.full(len(found), number, dtype=np.int32))
            where.append(found)
        return Addresses(np.concatenate(files), np.concatenate(where))

    def document(self, file: int, where: int) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """The document at an address of ``addresses()`` (an empty array for an empty one)."""
        if file < 0:
            return self._encode(self._demo()[where])
        path = self.files[file]
        if path.endswith(".jsonl"):
            with open(path, "rb") as f:
                f.seek(where)
                raw = f.readline()
            return self._jsonl_line(raw, path, _line_number(path, where))
        if path.endswith(".parquet"):
            return self._parquet_row(path, where)
        if path.endswith((".npy", ".bin")):
            array = self._mapped.get(path)
            if array is None:
                array = self._mapped[path] = next(_whole_npy(path)) if path.endswith(".npy") else next(self._read(path))
            return array if array.ndim == 1 else array[where]
        return next(self._read(path))

    def _locate(self, path: str) -> np.ndarray:
        if path.endswith(".jsonl"):
            return _line_starts(path)
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            self._parquet_columns(path)  # checked here, with its one-line error
            return np.arange(pq.ParquetFile(path).metadata.num_rows, dtype=np.int64)
        if path.endswith(".npy"):
            array = next(_whole_npy(path), None)
            if array is None:
                return np.zeros(0, dtype=np.int64)
            return np.arange(len(array) if array.ndim == 2 else 1, dtype=np.int64)
        if path.endswith(".bin"):  # checked (a whole number of tokens) and mapped, not read
            return np.zeros(1 if next(self._read(path), None) is not None else 0, dtype=np.int64)
        return np.zeros(1, dtype=np.int64)  # a text file: one document, tokenized when it is read

    def _parquet_row(self, path: str, row: int) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """One row, through a cache of the row group last read (sequential reads decode each group once)."""
        import pyarrow.parquet as pq

        cached = self._row_group
        if cached is None or cached[0] != path or not cached[1] <= row < cached[1] + len(cached[2]):
            table, columns = pq.ParquetFile(path), self._parquet_columns(path)
            first = 0
            for group in range(table.num_row_groups):
                size = table.metadata.row_group(group).num_rows
                if row < first + size:
                    break
                first += size
            cached = self._row_group = (path, first, table.read_row_group(group, columns=columns).to_pylist())
        record = cached[2][row - cached[1]]
        if self.text_field in record:
            return self._encode(record[self.text_field] or "")
        return self._chat_record(record, f"{path} row {row + 1}")

    def _parquet_columns(self, path: str) -> list[str]:
        import pyarrow.parquet as pq

        try:
            names = pq.ParquetFile(path).schema_arrow.names
        except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError kinds for a bad file
            raise TrainConfigError(f"data: {path} is not a readable parquet file ({str(e).splitlines()[0]}); "
                                   f"check the file or convert it to .jsonl") from None
        if self.text_field in names:
            return [self.text_field]
        columns = ["messages"] if "messages" in names else ["prompt", "completion"]
        if not set(columns) <= set(names):
            raise TrainConfigError(f"data: {path} has no column {self.text_field!r} (has {', '.join(names)}); "
                                   f"set --text-field, or give chat columns messages, or prompt and completion")
        return columns

    def _demo(self) -> list[str]:
        if self._demo_texts is None:
            self._demo_texts = demo_documents()
        return self._demo_texts

    def _encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text), dtype=np.int64)

    def _chat_record(self, record: dict, where: str) -> tuple[np.ndarray, np.ndarray]:
        if self._chat is None:
            self._chat = chat_data.ChatFormat(self.tokenizer, self.train_on)
        return self._chat.encode(record, where)

    def _read(self, path: str) -> Iterator[np.ndarray | tuple[np.ndarray, np.ndarray]]:
        if path.endswith(".jsonl"):
            yield from self._jsonl(path)
        elif path.endswith(".parquet"):
            yield from self._parquet(path)
        elif path.endswith(".npy"):
            yield from _npy(path)
        elif path.endswith(".bin"):
            if os.path.getsize(path) % self.token_dtype.itemsize:
                raise TrainConfigError(f"data: {path} is {os.path.getsize(path)} bytes, not a whole number of "
                                       f"{self.token_dtype} tokens; set --token-dtype to the file's type")
            if os.path.getsize(path):
                yield np.memmap(path, dtype=self.token_dtype, mode="r")
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield self._encode(f.read())

    def _jsonl(self, path: str) -> Iterator[np.ndarray | tuple[np.ndarray, np.ndarray]]:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if raw.strip():
                    yield self._jsonl_line(raw, path, lineno)

    def _jsonl_line(self, raw: bytes, path: str, lineno: int) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TrainConfigError(f"data: {path} line {lineno} is not UTF-8 (byte {e.start + 1}: "
                                   f"{raw[e.start:e.start + 1]!r}); re-encode the file as UTF-8") from None
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise TrainConfigError(f"data: {path} line {lineno} is not JSON ({e.msg}); one JSON object "
                                   f"per line") from None
        text = record.get(self.text_field) if isinstance(record, dict) else None
        if text is None and chat_data.is_chat(record):
            return self._chat_record(record, f"{path} line {lineno}")
        if not isinstance(text, str):
            raise TrainConfigError(f"data: {path} line {lineno} has no string field {self.text_field!r}; "
                                   f"set --text-field to the field that holds the text (or give chat "
                                   f"records \"messages\", or \"prompt\" and \"completion\")")
        return self._encode(text)

    def _parquet(self, path: str) -> Iterator[np.ndarray | tuple[np.ndarray, np.ndarray]]:
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises its own ArrowInvalid / OSError kinds for a bad file
            raise TrainConfigError(f"data: {path} is not a readable parquet file ({str(e).splitlines()[0]}); "
                                   f"check the file or convert it to .jsonl") from None
        names = table.schema_arrow.names
        if self.text_field not in names:
            columns = ["messages"] if "messages" in names else ["prompt", "completion"]
            if not set(columns) <= set(names):
                raise TrainConfigError(f"data: {path} has no column {self.text_field!r} (has {', '.join(names)}); "
                                       f"set --text-field, or give chat columns messages, or prompt and completion")
            row = 0
            for record_batch in table.iter_batches(columns=columns):
                for record in record_batch.to_pylist():
                    row += 1
                    yield self._chat_record(record, f"{path} row {row}")
            return
        for record_batch in table.iter_batches(columns=[self.text_field]):
            for text in record_batch.column(0).to_pylist():
                if text:
                    yield self._encode(text)


class Addresses(NamedTuple):
    """Documents by number: ``file`` (index into ``Corpus.files``; -1: the demo corpus) and ``where`` in it
    (a .jsonl line's byte offset; a parquet or 2-D .npy row; 0 for a file that is one document)."""

    file: np.ndarray   # int32
    where: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.file)


def _line_starts(path: str) -> np.ndarray:
    """Byte offsets of the lines of ``path`` that hold more than white space (read in pieces, at disk speed)."""
    newlines, done = [], 0
    with open(path, "rb") as f:
        while piece := f.read(LINE_SCAN_PIECE):
            newlines.append(np.flatnonzero(np.frombuffer(piece, dtype=np.uint8) == 10) + done)
            done += len(piece)
        ends = np.concatenate(newlines + [np.array([done], dtype=np.int64)]).astype(np.int64)
        starts = np.concatenate([np.zeros(1, dtype=np.int64), ends[:-1] + 1])
        keep = ends > starts
        for i in np.flatnonzero(keep & (ends - starts <= 16)):  # short lines: white space only?
            f.seek(int(starts[i]))
            keep[i] = bool(f.read(int(ends[i] - starts[i])).strip())
    return starts[keep]


def _line_number(path: str, offset: int) -> int:
    """The 1-based number of the line starting at byte ``offset`` (for error messages only)."""
    count, done = 1, 0
    with open(path, "rb") as f:
        while done < offset and (piece := f.read(min(LINE_SCAN_PIECE, offset - done))):
            count += piece.count(b"\n")
            done += len(piece)
    return count


def _whole_npy(path: str) -> Iterator[np.ndarray]:
    """The whole array of a .npy file (memory-mapped), checked as ``_npy`` checks it."""
    rows = _npy(path)
    if next(rows, None) is not None:
        yield np.load(path, mmap_mode="r", allow_pickle=False)


def _npy(path: str) -> Iterator[np.ndarray]:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise TrainConfigError(f"data: {path} is not a plain .npy array ({e}); save token ids with np.save") from None
    if array.dtype.kind not in "iu" or array.ndim not in (1, 2):
        raise TrainConfigError(f"data: {path} holds {array.dtype} of shape {array.shape}; expected integer token "
                               f"ids, 1-D (one document) or 2-D (one document per row)")
    if array.ndim == 1:
        if len(array):
            yield array
    else:
        yield from array


def expand(paths: tuple[str, ...]) -> list[str]:
    """Files named explicitly, plus the data files under each directory (sorted, recursively)."""
    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            for root, dirs, names in os.walk(p):
                dirs.sort()
                files += [os.path.join(root, n) for n in sorted(names) if n.endswith(DATA_SUFFIXES)]
        else:
            files.append(p)
    return files


def _require_pyarrow(path: str) -> None:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise TrainConfigError(f"data: {path} is parquet, which needs pyarrow; pip install pyarrow, or convert it "
                               f"to .jsonl") from None
