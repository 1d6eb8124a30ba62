"""Held-out evaluation: the eval set's rows, run through ``Engine.evaluate``, as one loss and perplexity.

The eval set is ``--eval-data`` (every document of those files) or the documents ``--eval-fraction`` holds
out of ``--data`` (data_order.split: by document, never by row, fixed by the seed, never trained on). Its
documents are packed in corpus order as training packs (same row length and separator) and evaluated in
batches of ``--batch`` rows, the last one possibly smaller, every row included: the padded last row's
padding is labelled -100 and counts for nothing. Rows are packed again at each evaluation rather than kept,
so an eval set costs no memory. The loss is the mean over every predicted token of the set (each batch's
mean weighted by its tokens, summed on the device in float64: one host sync per evaluation): the
language-model loss, without a mixture of experts' load-balancing term; the perplexity is exp(loss).

``Engine.evaluate`` streams the blocks as a training step's forward does, with the chunked loss, and leaves
the training state as it was: evaluating changes nothing about the run but the time it takes.
"""
from __future__ import annotations

import math
import time
from typing import Any, Iterator

import numpy as np
import torch

from . import packing
from .data import Addresses, Corpus
from .train_config import TrainConfig, TrainConfigError


class EvalSet:
    """The documents ``numbers`` of ``corpus``, packed into rows of ``seq_len``, batched ``batch`` rows at a time."""

    def __init__(self, corpus: Corpus, addresses: Addresses, numbers: np.ndarray, seq_len: int, batch: int,
                 separator_id: int, where: str, mode: str = "concat") -> None:
        self.corpus, self.addresses, self.numbers = corpus, addresses, numbers
        self.mode = mode  # packing.MODES, as the training rows
        self.seq_len, self.batch, self.separator_id = seq_len, batch, separator_id
        self.where = where  # for people: "--eval-data FILE" or "N documents held out of --data"
        tokens, labelled = 0, False
        for doc in self._documents():  # read until one full row and a labelled token are there (not the whole set)
            tokens += len(doc[0] if isinstance(doc, tuple) else doc) + 1
            labelled = labelled or not isinstance(doc, tuple) or bool((doc[1] != packing.IGNORE_INDEX).any())
            if tokens >= seq_len and labelled:
                break
        if tokens < seq_len:
            raise TrainConfigError(f"eval: the eval set ({where}) holds {tokens} token(s) with separators, less than "
                                   f"one row of --seq-len {seq_len}; give more eval data or a larger --eval-fraction")
        if not labelled:
            raise TrainConfigError(f"eval: no token of the eval set ({where}) is labelled (prompts only); give eval "
                                   f"data with completions, or --train-on all")

    def describe(self) -> str:
        return f"; eval set: {self.where}"

    def batches(self) -> Iterator[packing.Batch]:
        """Every row, the last batch possibly short."""
        rows = packing.pack(self._documents(), self.seq_len, self.separator_id, mode=self.mode)
        while group := [row for _, row in zip(range(self.batch), rows)]:
            positions = None if group[0].positions is None else torch.from_numpy(np.stack([g.positions for g in group]))
            yield packing.Batch(torch.from_numpy(np.stack([g.ids for g in group])),
                                torch.from_numpy(np.stack([g.labels for g in group])), positions)

    def evaluate(self, engine: Any) -> dict[str, float | int]:
        """``eval_loss``, ``eval_perplexity``, ``eval_tokens`` (tokens predicted), ``eval_token_accuracy`` (the
        share of them whose argmax is the label) and ``eval_time_s`` of the set, with ``engine``'s weights."""
        started = time.perf_counter()
        total: torch.Tensor | None = None
        correct: torch.Tensor | None = None  # predicted tokens whose argmax is their label, on the device
        tokens = 0
        for ids, labels, positions in self.batches():
            n = int((labels[:, 1:] != packing.IGNORE_INDEX).sum())
            if n == 0:
                continue  # a batch of prompts only: nothing to predict
            engine.evaluate(ids, labels, position_ids=positions)
            weighted = engine.lm_loss.double() * n  # the cross-entropy (a router's load-balancing term apart)
            total = weighted if total is None else total + weighted
            correct = engine.correct_tokens if correct is None else correct + engine.correct_tokens
            tokens += n
        if total is None:
            raise TrainConfigError(f"eval: no token of the eval set ({self.where}) is labelled (all -100); give "
                                   f"eval data with completions, or --train-on all")
        loss = float(total.item()) / tokens
        assert correct is not None
        return {"eval_loss": loss, "eval_perplexity": math.exp(loss) if loss < 700 else math.inf,
                "eval_tokens": tokens, "eval_token_accuracy": int(correct.item()) / tokens,
                "eval_time_s": time.perf_counter() - started}

    def _documents(self) -> Iterator[np.ndarray | tuple[np.ndarray, np.ndarray]]:
        file, where = self.addresses.file, self.addresses.where
        for number in self.numbers:
            doc = self.corpus.document(int(file[number]), int(where[number]))
            if len(doc[0] if isinstance(doc, tuple) else doc):
                yield doc


def describe(step: int, result: dict[str, Any]) -> str:
    """The line the progress display shows after an evaluation."""
    return (f"eval at step {step}: loss {result['eval_loss']:.4f}, perplexity {result['eval_perplexity']:.4g}, "
            f"token accuracy {100 * result['eval_token_accuracy']:.2f}% ({result['eval_tokens']:,} labelled tokens, "
            f"{result['eval_time_s']:.1f} s)")


def eval_set(config: TrainConfig, corpus: Corpus, addresses: Addresses, held_out: np.ndarray, separator_id: int,
             vocab_size: int, mode: str = "concat") -> EvalSet | None:
    """The run's eval set (``--eval-data``, or ``held_out`` of the training corpus), checked; None without one."""
    if config.eval_data:
        try:
            eval_corpus = Corpus(config.eval_data, corpus.tokenizer, config.text_field, config.token_dtype,
                                 config.train_on)
            eval_corpus.check_token_ids(vocab_size)
            found = eval_corpus.addresses()
        except TrainConfigError as e:  # the data's messages, said of the eval data
            raise TrainConfigError("eval_" + str(e) if str(e).startswith("data: ") else str(e)) from None
        if not len(found):
            raise TrainConfigError(f"eval_data: {', '.join(config.eval_data)} holds no document; give a file with "
                                   f"eval text or records")
        return EvalSet(eval_corpus, found, np.arange(len(found), dtype=np.int64), config.seq_len, config.batch,
                       separator_id, f"--eval-data {eval_corpus.describe()}", mode)
    if len(held_out):
        return EvalSet(corpus, addresses, held_out, config.seq_len, config.batch, separator_id,
                       f"{len(held_out)} document(s) held out of the training data", mode)
    if config.eval_every:  # checked here, once a resumed run's options are known
        raise TrainConfigError(f"eval_every={config.eval_every} but there is no eval set; give --eval-data or "
                               f"--eval-fraction")
    return None
