"""A mixture of experts' metrics count what they say: ``megatrain-train`` on a top-2-of-4 Qwen3-MoE that
transformers saved, its load-balancing loss on, over rows with padding. The experts' token counts leave the
padding out (against transformers' own router choices on the real tokens, and a hand count); ``loss`` is the
language-model loss, transformers' cross-entropy on the same weights and batch; ``aux_loss`` is reported apart
and ``train_objective`` is their weighted sum; ``eval_perplexity`` is exp(``eval_loss``).
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain.tools import train  # noqa: E402

SEP = 7  # --separator-id: between documents, and the padding's id
COEF = 0.01


def _model(directory: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=COEF,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=SEP)
    model = transformers.Qwen3MoeForCausalLM(config)
    model.save_pretrained(directory)
    return model.eval()


def _documents(tmp_path) -> tuple[list[str], list[np.ndarray]]:
    """Two pre-tokenized files: 5 documents of 29 tokens, 5 of 9 (30 and 10 with their separator).

    ``--packing whole --no-shuffle`` at 64 tokens a row, best-fit-decreasing, makes the rows
    [a0 a1 | 4 padding], [a2 a3 | 4], [a4 b0 b1 b2 | 4], [b3 b4 | 44]: step 1 trains the first two rows, step 2
    the last two."""
    rng = np.random.default_rng(0)
    a = rng.integers(10, 300, size=(5, 29))
    b = rng.integers(10, 300, size=(5, 9))
    paths = [str(tmp_path / "a.npy"), str(tmp_path / "b.npy")]
    np.save(paths[0], a)
    np.save(paths[1], b)
    return paths, [*a, *b]


def test_moe_counters_leave_padding_out_and_report_the_lm_loss_apart(tmp_path, capsys) -> None:
    model = _model(str(tmp_path / "model"))
    paths, docs = _documents(tmp_path)
    out = tmp_path / "run"
    argv = ["--model", str(tmp_path / "model"), "--tokenizer", "byte", "--separator-id", str(SEP), "--data", *paths,
            "--packing", "whole", "--no-shuffle", "--seq-len", "64", "--batch", "2", "--steps", "2",
            "--eval-data", paths[0], "--progress", "none", "--no-plot", "--warmup-steps", "1",
            "--compute-dtype", "fp32"]
    assert train.main(argv + ["--out", str(out)]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]

    # Step 1 (the weights transformers saved): its rows hold a0..a3, documents apart, 8 positions of padding.
    counts = torch.zeros(4, dtype=torch.int64)
    ce_sum, predicted = 0.0, 0
    for doc in docs[:4]:
        ids = torch.tensor([doc.tolist() + [SEP]])
        with torch.no_grad():
            hf = model(ids, output_router_logits=True)
        ce_sum += float(torch.nn.functional.cross_entropy(hf.logits[0, :-1].double(), ids[0, 1:], reduction="sum"))
        predicted += ids.shape[1] - 1  # each document's first token is not predicted
        for logits in hf.router_logits:  # [T, E] per layer: its top-2 experts of each real token
            counts += torch.bincount(torch.topk(logits, 2, dim=-1).indices.reshape(-1), minlength=4)
    first = rows[0]
    assert first["expert_tokens"] == counts.tolist()
    assert sum(first["expert_tokens"]) == 2 * 2 * (30 + 30 + 30 + 30)  # layers x top-2 x real positions, not 2 x 64
    assert abs(first["loss"] - ce_sum / predicted) <= 1e-5 * ce_sum / predicted
    # Step 2: rows [a4 b0 b1 b2 | 4 padding] and [b3 b4 | 44 padding].
    assert sum(rows[1]["expert_tokens"]) == 2 * 2 * (60 + 20)
    for r in rows:  # the load-balancing loss apart; the total the step minimised named as such
        assert r["aux_loss"] > 0
        assert abs(r["train_objective"] - (r["loss"] + COEF * r["aux_loss"])) <= 1e-6 * r["train_objective"]
    assert rows[-1]["eval_perplexity"] == pytest.approx(math.exp(rows[-1]["eval_loss"]), rel=1e-12)
    # The eval loss is the cross-entropy alone: exp of it is what the summary calls perplexity.
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss"] == rows[-1]["eval_loss"] and summary["last_loss"] == rows[-1]["loss"]
