"""The tokenizer a run trains with agrees with the one transformers builds for the same directory.

megatrain reads ``tokenizer.json`` as written (the ``tokenizers`` package); transformers' ``AutoTokenizer``
may build another tokenizer from the same directory (its ``tokenizer_config.json`` names a class whose
own normalizer or pre-tokenizer replaces the file's; transformers 5 builds the model type's class, e.g.
``Qwen2Tokenizer`` for a qwen2 directory), and a model trained with one and served with the
other sees other tokens. At start-up, when transformers is installed and the tokenizer's directory holds
its files, the first ``SAMPLE_DOCUMENTS`` documents of the data are encoded both ways (each text exactly
as the run encodes it: a chat record's rendering, prompt and completion), and a chat record's assistant
mask (``{% generation %}`` blocks) is compared with transformers'
``apply_chat_template(..., return_assistant_tokens_mask=True)``: any difference is refused in one line.
An explicit ``--tokenizer`` is the user's choice and is not checked.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

import numpy as np

from . import chat_data
from .data import Corpus
from .train_config import TrainConfigError

# Documents of the data encoded both ways at start-up (a few milliseconds each).
SAMPLE_DOCUMENTS = 32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class _Recording:
    """A tokenizer that keeps every text it is asked to encode."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.vocab_size, self.separator_id = tokenizer.vocab_size, tokenizer.separator_id
        self.directory = tokenizer.directory
        self.texts: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.texts.append(text)
        return self._tokenizer.encode(text)

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        self.texts.append(text)
        return self._tokenizer.encode_offsets(text)


def check(tokenizer: Any, data: tuple[str, ...], text_field: str, token_dtype: str, train_on: str,
          tokenizer_flag: str = "--tokenizer") -> None:
    """Refuse, in one line, a tokenizer that transformers builds otherwise (ids or assistant masks)."""
    directory = getattr(tokenizer, "directory", None)
    if not directory or not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return
    hf = _auto_tokenizer(directory)
    if hf is None:
        return
    recording = _Recording(tokenizer)
    documents = Corpus(data, recording, text_field, token_dtype, train_on).documents()
    for _ in zip(range(SAMPLE_DOCUMENTS), documents):
        pass
    for text in recording.texts:
        ours, theirs = tokenizer.encode(text), list(hf.encode(text, add_special_tokens=False))
        if ours != theirs:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            raise TrainConfigError(
                f"tokenizer: transformers' AutoTokenizer builds another tokenizer from {directory} than its "
                f"tokenizer.json ({type(hf).__name__}: token {at} of {text[:40]!r}... is "
                f"{_at(theirs, at)} there, {_at(ours, at)} here), so the model would be served other tokens than "
                f"it was trained on; save the tokenizer transformers builds (AutoTokenizer.from_pretrained(D)"
                f".save_pretrained(D)), or pass {tokenizer_flag} {os.path.join(directory, 'tokenizer.json')} to "
                f"train with the file as written")
    if train_on == "completion":
        _check_masks(tokenizer, hf, data, directory, tokenizer_flag)


def _check_masks(tokenizer: Any, hf: Any, data: tuple[str, ...], directory: str, tokenizer_flag: str) -> None:
    """The assistant tokens the chat template's generation blocks mark are the ones transformers marks."""
    chat = chat_data.ChatFormat(tokenizer, "completion")
    if not chat.has_generation_blocks:
        return
    for record, where in _chat_records(data):
        ids, labels = chat.encode(record, where)
        mask = (labels != -100).astype(np.int64).tolist()
        try:
            out = hf.apply_chat_template(record["messages"], tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
        except Exception:  # a template transformers cannot run here: nothing to compare with
            return
        if list(out["input_ids"]) != ids.tolist() or list(out["assistant_masks"]) != mask:
            raise TrainConfigError(
                f"tokenizer: the chat template's generation blocks in {directory} mark other assistant tokens "
                f"than transformers' apply_chat_template(return_assistant_tokens_mask=True) does ({where}); fix "
                f"the template's {{% generation %}} blocks, or pass {tokenizer_flag} to train with this file as "
                f"written")


def _chat_records(data: tuple[str, ...]) -> Iterator[tuple[dict, str]]:
    """The first ``SAMPLE_DOCUMENTS`` chat records with messages in the data's .jsonl files."""
    from .data import expand

    seen = 0
    for path in expand(data):
        if not path.endswith(".jsonl"):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if seen >= SAMPLE_DOCUMENTS:
                    return
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "messages" in record and chat_data.is_chat(record):
                    seen += 1
                    yield record, f"{path} line {lineno}"


def _auto_tokenizer(directory: str) -> Any:
    """transformers' tokenizer for ``directory``; None without transformers or when it cannot build one."""
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging
    except ImportError:
        return None
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its advice on the files is not ours to print
    try:
        return AutoTokenizer.from_pretrained(directory)
    except Exception:  # transformers cannot load this directory at all: there is no other tokenizer to agree with
        return None
    finally:
        logging.set_verbosity(verbosity)


def _at(ids: list[int], i: int) -> str:
    return str(ids[i]) if i < len(ids) else "the end"
