"""Tokenizers for the training command: byte-level (built in) or a Hugging Face ``tokenizer.json``.

Each gives ``encode(text) -> list[int]``, ``encode_offsets(text)`` (the ids and each token's character
span, for chat labels), ``vocab_size`` and ``separator_id`` (the token placed between documents when
packing: an end-of-text token). ``directory`` is where the tokenizer's files are (None: built in).
"""
from __future__ import annotations

import json
import os
from typing import Protocol

from .train_config import TrainConfigError

# End-of-text names, most common first, looked up when the tokenizer does not say which is its EOS.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")


class Tokenizer(Protocol):
    vocab_size: int
    separator_id: int
    directory: str | None

    def encode(self, text: str) -> list[int]: ...

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, and 256 as the end-of-document separator: 257 ids."""

    vocab_size = 257
    separator_id = 256
    directory = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for i, char in enumerate(text):
            encoded = char.encode("utf-8")
            ids += encoded
            offsets += [(i, i + 1)] * len(encoded)
        return ids, offsets

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` package (no special tokens added per document)."""

    def __init__(self, path: str, separator_id: int = -1) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise TrainConfigError(f"tokenizer: {path} needs the `tokenizers` package; pip install tokenizers, "
                                   f"or use --tokenizer byte") from None
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        try:
            self._tok = _Tokenizer.from_file(file)
        except Exception as e:  # the tokenizers package raises a bare Exception on bad files
            raise TrainConfigError(f"tokenizer: cannot read {file} ({str(e).splitlines()[0]}); pass a "
                                   f"Hugging Face tokenizer.json") from None
        self.directory = os.path.dirname(os.path.abspath(file))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.separator_id = separator_id if separator_id >= 0 else self._find_eos(file)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def _find_eos(self, file: str) -> int:
        names = list(EOS_NAMES)
        config = os.path.join(os.path.dirname(file), "tokenizer_config.json")
        if os.path.exists(config):
            with open(config, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                names.insert(0, eos)
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        raise TrainConfigError(f"tokenizer: {file} has no end-of-text token ({', '.join(EOS_NAMES)}); "
                               f"set --separator-id to the id placed between documents")


def load(spec: str, separator_id: int = -1) -> Tokenizer:
    """``"byte"`` or a tokenizer.json path (or the directory holding one)."""
    if spec == "byte":
        tok = ByteTokenizer()
        if separator_id >= 0:
            if separator_id >= tok.vocab_size:
                raise TrainConfigError(f"separator_id={separator_id} is outside the byte tokenizer's "
                                       f"{tok.vocab_size} ids; leave it at -1")
            tok.separator_id = separator_id
        return tok
    return HFTokenizer(spec, separator_id)
