"""megatrain's packed rows handed to TRL, and the check that transformers keeps their documents apart.

For the ``packed`` layout of trl_parity.py both tools must train on the same rows. The rows are megatrain's:
``megatrain_rows`` builds them through the same calls megatrain-train makes (the options parsed from the same
command line, the same tokenizer, corpus, packing mode and data order), and ``trl_dataset`` turns each row
into a TRL example: its tokens and labels without the row's padding, and ``seq_lengths``, the length of each
document in it, from which TRL's ``DataCollatorForLanguageModeling(padding_free=True)`` rebuilds the position
ids (0 at each document's start), flattens a batch's rows into one sequence and labels each document's first
token -100 (as megatrain does). transformers then finds the documents from the position ids (masking_utils'
packed-sequence detection, used when no attention mask is given) and keeps attention within each, which
``check_document_attention`` verifies on the model itself before the runs.
"""
from __future__ import annotations

import numpy as np


def megatrain_rows(argv: list[str], steps: int) -> tuple[list[list[dict]], float]:
    """The rows of megatrain-train's first ``steps`` steps for ``argv`` (its options), ``steps`` lists of
    ``--batch`` rows ({"ids", "labels", "positions", "padding"}), and the padding fraction of those rows."""
    from megatrain.tools import data_order, train_options
    from megatrain.tools import tokenizer as tokenizers
    from megatrain.tools.data import Corpus

    c = train_options.parse(argv)
    tokenizer = tokenizers.load(c.tokenizer, c.separator_id)
    corpus = Corpus(c.data, tokenizer, c.text_field, c.token_dtype, c.train_on)
    mode = data_order.packing_mode(c.packing, corpus)
    data, _ = data_order.training_data(c, corpus, tokenizer.separator_id, mode=mode)
    rows = data._rows()  # the rows batches() groups, one at a time, so that each row's padding is known
    steps_rows: list[list[dict]] = []
    for _ in range(steps):
        group = []
        for _ in range(c.batch):
            padding_before = data.packed.padding
            row = next(rows)
            group.append({"ids": row.ids, "labels": row.labels, "positions": row.positions,
                          "padding": data.packed.padding - padding_before})
        steps_rows.append(group)
    return steps_rows, data.packed.padding_fraction


def trl_dataset(steps_rows: list[list[dict]]):
    """A ``datasets.Dataset`` of the rows in training order: input_ids, labels, seq_lengths (padding left out)."""
    from datasets import Dataset

    examples: dict[str, list] = {"input_ids": [], "labels": [], "seq_lengths": []}
    for group in steps_rows:
        for row in group:
            used = len(row["ids"]) - row["padding"]
            positions = row["positions"][:used]
            starts = np.flatnonzero(positions == 0).tolist() + [used]
            examples["input_ids"].append(row["ids"][:used].tolist())
            examples["labels"].append(row["labels"][:used].tolist())
            examples["seq_lengths"].append([b - a for a, b in zip(starts, starts[1:])])
    return Dataset.from_dict(examples)


def check_document_attention(model_dir: str, dataset, rows: int) -> dict:
    """Per-token losses of the documents of the first ``rows`` examples, collated by TRL (one flat sequence)
    and run through the transformers model (fp32, sdpa), against each document run alone; and the same with
    the position ids left out (attention across documents), which must differ, so the check can fail."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    examples = [dataset[i] for i in range(rows)]
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples)
    lengths = [n for e in examples for n in e["seq_lengths"]]

    def token_losses(inputs: dict) -> torch.Tensor:  # [tokens - 1] the loss of predicting each next token
        with torch.no_grad():
            logits = model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False).logits[0]
        return torch.nn.functional.cross_entropy(logits[:-1], inputs["labels"][0, 1:], reduction="none",
                                                 ignore_index=-100)

    packed = token_losses(batch)
    across = token_losses({"input_ids": batch["input_ids"], "labels": batch["labels"]})
    alone, at = [], 0
    for n in lengths:
        ids = batch["input_ids"][:, at:at + n]
        alone.append(token_losses({"input_ids": ids, "labels": batch["labels"][:, at:at + n]}))
        alone.append(torch.zeros(1))  # the document's last token predicts the next one's first, labelled -100
        at += n
    alone = torch.cat(alone)[:-1]
    return {"documents": len(lengths), "tokens": int(batch["input_ids"].numel()),
            "max_abs_token_loss_diff_packed_vs_alone": float((packed - alone).abs().max()),
            "max_abs_token_loss_diff_without_position_ids": float((across - alone).abs().max())}
