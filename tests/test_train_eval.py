"""megatrain-train's shuffle, epochs, held-out evaluation and --export-on-finish, run as a user runs them."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from megatrain.runtime import Engine
from megatrain.tools import data_order, evaluation, metrics, train, train_config
from megatrain.tools.data import Corpus
from megatrain.tools.tokenizer import ByteTokenizer

from test_train_runs import FAST, one_error_line, snapshot

SMALL = ["--seq-len", "32", "--batch", "2", "--progress", "none", "--no-plot", "--warmup-steps", "1",
         "--compute-dtype", "fp32"]


def corpus_file(tmp_path, n=30) -> str:
    path = tmp_path / "docs.jsonl"
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    path.write_text("\n".join(json.dumps({"text": " ".join(words[(i + j) % 6] for j in range(3 + i % 7))})
                              for i in range(n)) + "\n")
    return str(path)


def rows(out) -> list[dict]:
    return metrics.read_metrics(os.path.join(out, "metrics.jsonl"))


def test_resume_of_a_shuffled_multi_epoch_run_with_evaluation_equals_the_uninterrupted_run(tmp_path):
    data = corpus_file(tmp_path, n=12)
    common = ["--data", data, "--eval-fraction", "0.2", "--eval-every", "3", "--seed", "4"] + SMALL
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train.main(["--out", str(straight), "--steps", "14"] + common) == 0
    assert train.main(["--out", str(split), "--steps", "14", "--save-every", "5"] + common) == 0
    assert train.main(["--resume", str(split / "checkpoints" / "step-00000005"), "--out", str(tmp_path / "resumed"),
                       "--progress", "none"]) == 0
    a, b = rows(straight), rows(tmp_path / "resumed")
    assert [r["step"] for r in b] == list(range(6, 15))
    for key in ("loss", "epoch", "grad_norm"):
        assert [r[key] for r in b] == [r[key] for r in a[5:]], key
    assert a[-1]["epoch"] > 2  # the run went through several epochs
    evaluated = [r for r in a if "eval_loss" in r]
    assert [r["step"] for r in evaluated] == [3, 6, 9, 12, 14]  # every 3 steps and at the end
    assert [r["eval_loss"] for r in b if "eval_loss" in r] == [r["eval_loss"] for r in evaluated[1:]]
    for r in evaluated:
        assert r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"])) and r["eval_tokens"] > 0
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["eval_loss"] == evaluated[-1]["eval_loss"] and summary["eval_step"] == 14
    # The shuffle changes what is trained: --no-shuffle (corpus order) gives other losses from step 2 on.
    assert train.main(["--out", str(tmp_path / "in-order"), "--steps", "4", "--no-shuffle"] + common) == 0
    assert [r["loss"] for r in rows(tmp_path / "in-order")] != [r["loss"] for r in a[:4]]


def test_the_eval_loss_is_the_held_out_documents_loss_with_the_final_weights(tmp_path):
    data = corpus_file(tmp_path)
    out = tmp_path / "run"
    assert train.main(["--out", str(out), "--data", data, "--eval-fraction", "0.3", "--steps", "3"] + SMALL) == 0
    reported = rows(out)[-1]["eval_loss"]
    # The same documents, chosen again by the seed, packed and run through plain PyTorch on the checkpoint's logits.
    corpus = Corpus((data,), ByteTokenizer())
    addresses = corpus.addresses()
    train_ids, held_out = data_order.split(len(addresses), 0.3, 0)
    held_text = {corpus.document(int(addresses.file[i]), int(addresses.where[i])).tobytes() for i in held_out}
    trained_text = {corpus.document(int(addresses.file[i]), int(addresses.where[i])).tobytes() for i in train_ids}
    assert held_text and not held_text & trained_text  # (the documents are all different)
    config = train_config.build({"data": (data,), "eval_fraction": 0.3, "seq_len": 32, "batch": 2})
    evals = evaluation.eval_set(config, corpus, addresses, held_out, ByteTokenizer.separator_id, 257)
    with Engine.load_checkpoint(out / "checkpoints", device="cpu") as engine:
        assert evals.evaluate(engine)["eval_loss"] == reported
        losses, count = 0.0, 0
        for ids, labels, positions in evals.batches():
            shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
            logits = engine.logits(ids, position_ids=positions)
            losses += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100,
                                      reduction="sum").item()
            count += int((shifted != -100).sum())
    assert reported == pytest.approx(losses / count, rel=1e-5)


def test_eval_data_files(tmp_path, capsys):
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(json.dumps({"text": "held out text " * 20}) + "\n")
    out = tmp_path / "run"
    assert train.main(["--out", str(out), "--steps", "2", "--eval-data", str(eval_file)] + SMALL) == 0
    last = rows(out)[-1]
    assert "eval_loss" in last and "eval_loss" not in rows(out)[0]  # at the end only by default
    assert "eval at step 2: loss" in capsys.readouterr().err


def test_bad_eval_and_export_options_are_one_line_and_write_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    short = tmp_path / "short.jsonl"
    short.write_text(json.dumps({"text": "tiny"}) + "\n")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    cases = [
        (["--eval-fraction", "1.5"], "eval_fraction=1.5 must be in [0, 1)"),
        (["--eval-fraction", "-0.1"], "eval_fraction=-0.1 must be in [0, 1)"),
        (["--eval-data", str(tmp_path / "missing.jsonl")], "eval_data: "),
        (["--eval-data", str(empty)], "holds no document"),
        (["--eval-data", str(short)], "less than one row of --seq-len 32"),
        (["--eval-every", "5"], "there is no eval set"),
        (["--eval-data", str(short), "--eval-fraction", "0.1"], "not both"),
        (["--export-on-finish", str(full)], "export_on_finish: "),
        (["--out", str(tmp_path / "exp" / "run"), "--export-on-finish", str(tmp_path / "exp")], "would hold --out"),
        (["--export-dtype", "fp16"], "invalid choice"),
    ]
    for args, fragment in cases:
        capsys.readouterr()
        assert train.main(["--out", str(out), "--steps", "2"] + FAST + args) == 2, args
        assert fragment in one_error_line(capsys), args
        assert not out.exists() and not (tmp_path / "exp").exists() and (full / "keep.txt").read_text() == "mine"
    # The data order and the held-out split cannot change on resume; the eval cadence can. (A small corpus: a tenth
    # of the demo's is some 700 eval rows, evaluated twice.)
    data = corpus_file(tmp_path)
    assert train.main(["--out", str(out), "--steps", "2", "--data", data, "--eval-fraction", "0.1"] + FAST) == 0
    before = snapshot(out)
    for args, key in [(["--no-shuffle"], "shuffle"), (["--eval-fraction", "0.2"], "eval_fraction"),
                      (["--seed", "1"], "seed")]:
        capsys.readouterr()
        assert train.main(["--resume", str(out), "--steps", "3"] + args) == 2
        assert f"{key} cannot change in a resumed run" in one_error_line(capsys)
        assert snapshot(out) == before
    assert train.main(["--resume", str(out), "--steps", "3", "--eval-every", "1", "--progress", "none"]) == 0
    assert "eval_loss" in rows(out)[-1]


def test_export_on_finish_writes_a_directory_transformers_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from chat_model import RECORDS, write_model, write_tokenizer

    model = write_model(write_tokenizer(str(tmp_path / "model")), vocab_size=300)
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS * 4) + "\n")
    out, exported = tmp_path / "run", tmp_path / "exported"
    assert train.main(["--model", model, "--data", str(data), "--out", str(out), "--export-on-finish", str(exported),
                       "--export-dtype", "fp32", "--steps", "2"] + SMALL) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported)
    tok = transformers.AutoTokenizer.from_pretrained(exported)
    assert tok.chat_template and hf.lm_head.weight.dtype == torch.float32
    with Engine.load_checkpoint(out / "checkpoints", device="cpu") as engine:
        trained = engine.state_dict()
    for name, value in hf.state_dict().items():
        assert torch.equal(value, trained[name]), name
    summary = json.loads((out / "summary.json").read_text())
    assert summary["export"] == str(exported) and summary["exit_code"] == 0
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    generated = hf.generate(**prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 3


def test_a_failed_export_keeps_the_run_and_says_how_to_export(tmp_path, capsys, monkeypatch):
    from megatrain.tools import export

    def full_disk(source, out, dtype="bf16", say=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "export", full_disk)
    out = tmp_path / "run"
    assert train.main(["--out", str(out), "--steps", "2", "--export-on-finish", str(tmp_path / "model")] + FAST) == 1
    err = capsys.readouterr().err
    assert "export to" in err and "No space left on device" in err and "megatrain-export" in err
    assert os.path.isdir(out / "checkpoints" / "step-00000002") and not (tmp_path / "model").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_code"] == 1 and summary["export"].startswith("failed")
