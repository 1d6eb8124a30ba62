"""megatrain-train --packing: documents / concat / none through the command, resume, defaults, bad combinations.

The runtime side (attention and positions per document, against transformers) is tests/test_document_attention.py;
the rows themselves are tests/test_packing.py.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megatrain.tools import metrics, packing, train
from megatrain.tools.data import Corpus
from megatrain.tools.tokenizer import ByteTokenizer

FAST = ["--seq-len", "32", "--batch", "2", "--progress", "none", "--no-plot", "--warmup-steps", "1",
        "--compute-dtype", "fp32", "--no-shuffle"]  # corpus order: the tests count the rows it packs


def _short_documents(path) -> str:
    """Plain-text records of 3 to 40 bytes: rows of 32 tokens hold several documents each."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta"]
    lines = [json.dumps({"text": " ".join(rng.choice(words, rng.integers(1, 7)))}) for _ in range(60)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _losses(out) -> list[float]:
    return [r["loss"] for r in metrics.read_metrics(os.path.join(out, "metrics.jsonl"))]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatrain-train: error: ") and "Traceback" not in err, err
    return err


def test_documents_packing_trains_resumes_exactly_and_differs_from_concat(tmp_path, capsys):
    data = _short_documents(tmp_path / "docs.jsonl")
    common = ["--data", data, "--packing", "documents"] + FAST
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train.main(["--out", str(straight), "--steps", "4"] + common) == 0
    assert "packing documents" in capsys.readouterr().err
    assert train.main(["--out", str(split), "--steps", "4", "--save-every", "2"] + common) == 0
    resumed = tmp_path / "resumed"
    assert train.main(["--resume", str(split / "checkpoints" / "step-00000002"), "--out", str(resumed),
                       "--progress", "none"]) == 0
    # The data position and the rows' boundaries come back with the checkpoint: the same losses (fp32, CPU).
    assert _losses(resumed) == _losses(straight)[2:]
    # The tokens trained on are the documents rows' labels: each document's first token is not predicted.
    rows = list(packing.pack(Corpus((data,), ByteTokenizer()).documents(), 32, ByteTokenizer().separator_id,
                             mode="documents"))
    expected = sum(int((r.labels[1:] != packing.IGNORE_INDEX).sum()) for r in rows[:8])
    last = metrics.read_metrics(str(straight / "metrics.jsonl"))[-1]
    assert last["trained_tokens"] == expected and last["tokens"] == 4 * 2 * 32  # labelled; positions processed
    # Plain text packs end to end by default (concat): other tokens, another loss.
    concat = tmp_path / "concat"
    assert train.main(["--out", str(concat), "--steps", "1", "--data", data] + FAST) == 0
    assert "packing concat" in capsys.readouterr().err
    assert abs(_losses(concat)[0] - _losses(straight)[0]) > 1e-4


def test_packing_none_is_one_padded_document_per_row(tmp_path, capsys):
    data = _short_documents(tmp_path / "docs.jsonl")
    out = tmp_path / "run"
    assert train.main(["--out", str(out), "--steps", "2", "--data", data, "--packing", "none"] + FAST) == 0
    rows = list(packing.pack(Corpus((data,), ByteTokenizer()).documents(), 32, ByteTokenizer().separator_id,
                             mode="none"))
    expected = sum(int((r.labels[1:] != packing.IGNORE_INDEX).sum()) for r in rows[:4])
    assert metrics.read_metrics(str(out / "metrics.jsonl"))[-1]["trained_tokens"] == expected < 4 * 31


def test_bad_packing_combinations_are_one_line(tmp_path, capsys):
    (np.arange(500) % 250).astype(np.uint16).tofile(tmp_path / "tokens.bin")
    out = tmp_path / "run"
    assert train.main(["--out", str(out), "--data", str(tmp_path / "tokens.bin"), "--packing", "none"] + FAST) == 2
    assert "tokens.bin is one document" in _one_error_line(capsys)
    np.save(tmp_path / "one.npy", np.arange(500) % 250)
    assert train.main(["--out", str(out), "--data", str(tmp_path / "one.npy"), "--packing", "none"] + FAST) == 2
    assert "one.npy is one document" in _one_error_line(capsys)
    np.save(tmp_path / "rows.npy", (np.arange(500) % 250).reshape(10, 50))  # 2-D: a document per row, fine
    assert train.main(["--out", str(tmp_path / "rows"), "--data", str(tmp_path / "rows.npy"), "--packing", "none",
                       "--steps", "1"] + FAST) == 0
    capsys.readouterr()
    assert train.main(["--out", str(out), "--packing", "sideways"] + FAST) == 2
    assert "invalid choice: 'sideways'" in _one_error_line(capsys)
    assert not out.exists()
    # The packing is part of the run: its rows are the data position a checkpoint counts in.
    data = _short_documents(tmp_path / "docs.jsonl")
    assert train.main(["--out", str(out), "--steps", "1", "--data", data, "--packing", "documents"] + FAST) == 0
    capsys.readouterr()
    assert train.main(["--resume", str(out), "--steps", "2", "--packing", "concat"]) == 2
    assert "packing cannot change in a resumed run" in _one_error_line(capsys)


def test_chat_data_packs_whole_documents_by_default_and_an_older_run_resumes_as_concat(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    pytest.importorskip("transformers")
    from chat_model import RECORDS, write_model, write_tokenizer

    model = write_model(write_tokenizer(str(tmp_path / "model")), vocab_size=300)
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS * 8) + "\n")
    out = tmp_path / "run"
    argv = ["--model", model, "--data", str(data), "--out", str(out), "--steps", "2"] + FAST
    assert train.main(argv) == 0
    assert "packing whole" in capsys.readouterr().err
    # A checkpoint written before --packing existed (no packing in its settings) packed end to end: a resume
    # keeps doing so, whatever the data.
    step = out / "checkpoints" / "step-00000002"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["extra"]["train_config"].pop("packing") == "auto"
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert train.main(["--resume", str(out), "--steps", "3", "--progress", "none"]) == 0
    assert "packing concat" in capsys.readouterr().err
