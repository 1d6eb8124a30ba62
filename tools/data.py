"""Training data: where documents come from, as arrays of token ids.

A ``Corpus`` yields documents in a fixed order (the same every epoch, so a run resumes by
counting sequences). Sources, by file extension:

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
"""
from __future__ import annotations

import json
import os
from typing import Iterator

import numpy as np

from . import chat_data
from .tokenizer import Tokenizer
from .train_config import TrainConfigError

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst")
# Token ids checked per piece of a pre-tokenized file (bounds the memory of the check: 8 MiB of int64).
ID_CHECK_PIECE = 1 << 20
DATA_SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet", ".npy", ".bin")


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
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise TrainConfigError(f"data: {path} line {lineno} is not UTF-8 (byte {e.start + 1}: "
                                           f"{raw[e.start:e.start + 1]!r}); re-encode the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TrainConfigError(f"data: {path} line {lineno} is not JSON ({e.msg}); one JSON object "
                                           f"per line") from None
                text = record.get(self.text_field) if isinstance(record, dict) else None
                if text is None and chat_data.is_chat(record):
                    yield self._chat_record(record, f"{path} line {lineno}")
                    continue
                if not isinstance(text, str):
                    raise TrainConfigError(f"data: {path} line {lineno} has no string field {self.text_field!r}; "
                                           f"set --text-field to the field that holds the text (or give chat "
                                           f"records \"messages\", or \"prompt\" and \"completion\")")
                yield self._encode(text)

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
