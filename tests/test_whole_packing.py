"""--packing whole (tools/bin_packing.py): every document whole in one row, best-fit-decreasing, deterministic;
through megatrain-train: the default for chat data, exact resume, and an eval loss equal to transformers'
per-conversation loss on the exported model."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, strategies as st

from megatrain.tools import metrics, packing, train
from megatrain.tools.bin_packing import best_fit_decreasing
from megatrain.tools.data import Corpus

SEP, PAD = 99, 98  # never a document token: document k holds 100k .. 100k + 30
IGNORE = packing.IGNORE_INDEX
FAST = ["--batch", "2", "--progress", "none", "--no-plot", "--warmup-steps", "1", "--compute-dtype", "fp32"]


def _segments(row: packing.Row, padding: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (ids, labels) of each segment of a row (positions restart at 0), the padding left out."""
    used = len(row.ids) - padding
    starts = [int(i) for i in np.flatnonzero(row.positions[:used] == 0)] + [used]
    return [(row.ids[a:b], row.labels[a:b]) for a, b in zip(starts, starts[1:])]


@given(lengths=st.lists(st.integers(0, 30), max_size=25), seq_len=st.integers(2, 17), trained=st.booleans())
def test_whole_packing_places_every_token_once_whole_and_deterministically(lengths, seq_len, trained):
    # Document k holds the distinct ids 100k, 100k+1, ...: where each token went can be read off the rows.
    docs = [(np.arange(100 * k, 100 * k + n), np.arange(100 * k, 100 * k + n) if trained else np.full(n, IGNORE))
            for k, n in enumerate(lengths)]
    figures = packing.RowFigures()
    rows, seen = [], []
    for row in packing.pack(iter(docs), seq_len, SEP, pad_id=PAD, mode="whole", figures=figures):
        rows.append(row)
        seen.append((figures.padding, figures.documents, figures.cut))
        assert row.ids.shape == row.labels.shape == row.positions.shape == (seq_len,)
        assert 0 <= figures.padding < seq_len  # no row over capacity, and none empty
        assert (row.ids[seq_len - figures.padding:] == PAD).all()
        assert (row.labels[seq_len - figures.padding:] == IGNORE).all()
    again = list(packing.pack(iter(docs), seq_len, SEP, pad_id=PAD, mode="whole"))
    assert all((a.ids == b.ids).all() and (a.labels == b.labels).all() and (a.positions == b.positions).all()
               for a, b in zip(rows, again)) and len(again) == len(rows)
    # Every token (and each document's separator) placed exactly once; a document that fits a row is one
    # segment of one row, whole and in order, starting at position 0 with its first token unpredicted.
    placed: dict[int, list[int]] = {}
    for row, (padding, _, _) in zip(rows, seen):
        for ids, labels in _segments(row, padding):
            assert labels[0] == IGNORE
            owner = int(ids[0]) // 100 if ids[0] != SEP else None
            for t, (i, lab) in enumerate(zip(ids.tolist(), labels.tolist())):
                if i != SEP:
                    assert i // 100 == owner if owner is not None else False
                    placed.setdefault(i // 100, []).append(i)
                    assert t == 0 or lab == (i if trained else IGNORE)
            if owner is not None and lengths[owner] + 1 <= seq_len:
                assert ids.tolist() == list(range(100 * owner, 100 * owner + lengths[owner])) + [SEP]
    for k, n in enumerate(lengths):
        assert sorted(placed.get(k, [])) == list(range(100 * k, 100 * k + n))
    assert sum(seq_len - p for p, _, _ in seen) == sum(n + 1 for n in lengths)
    assert sum(d for _, d, _ in seen) == len(lengths)
    assert sum(c for _, _, c in seen) == sum(n + 1 > seq_len for n in lengths)


def test_best_fit_decreasing_fills_the_fullest_row_that_holds_each_document():
    # Longest first: 6 opens a row (room 4), 5 opens another (room 5), 4 goes beside 6 (the least room that
    # holds it), 3 and then 1 beside 5; rows come out ordered by their first document.
    assert best_fit_decreasing([3, 6, 4, 5, 1], 10) == [[0, 3, 4], [1, 2]]
    assert best_fit_decreasing([], 4) == []


def _chat_set(tmp_path, count: int, seed: int) -> str:
    """Conversations of varied length: at --seq-len 64 many straddle row ends when packed end to end."""
    rng = np.random.default_rng(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "slept", "well"]
    records = []
    for _ in range(count):
        question = " ".join(rng.choice(words, rng.integers(1, 7)))
        answer = " ".join(rng.choice(words, rng.integers(1, 7)))
        records.append({"messages": [{"role": "user", "content": question},
                                     {"role": "assistant", "content": answer}]})
    path = tmp_path / f"chat{seed}.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    pytest.importorskip("transformers")
    from chat_model import write_model, write_tokenizer

    return write_model(write_tokenizer(str(tmp_path_factory.mktemp("model"))), vocab_size=300)


def test_chat_rows_hold_whole_conversations_where_end_to_end_packing_cuts_them(chat_model, tmp_path):
    from megatrain.tools import tokenizer as tokenizers

    tok = tokenizers.load(chat_model)
    data = _chat_set(tmp_path, 40, seed=1)
    docs = list(Corpus((data,), tok).documents())
    assert all(len(ids) + 1 <= 64 for ids, _ in docs)
    cut = packing.RowFigures()
    assert sum(cut.cut for _ in packing.pack(iter(docs), 64, tok.separator_id, mode="documents", figures=cut)) > 5
    figures = packing.RowFigures()
    wanted = sorted((ids.tolist() + [tok.separator_id]) for ids, _ in docs)
    got = []
    for row in packing.pack(iter(docs), 64, tok.separator_id, mode="whole", figures=figures):
        assert figures.cut == 0
        got += [ids.tolist() for ids, _ in _segments(row, figures.padding)]
    assert sorted(got) == wanted  # every row's documents start at position 0 and are complete


def test_whole_packing_resumes_exactly_and_its_eval_loss_is_per_conversation_scoring(chat_model, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from megatrain.tools import tokenizer as tokenizers

    data, held = _chat_set(tmp_path, 48, seed=2), _chat_set(tmp_path, 12, seed=3)
    common = ["--model", chat_model, "--data", data, "--eval-data", held, "--seq-len", "64"] + FAST
    straight, split = tmp_path / "straight", tmp_path / "split"
    export = tmp_path / "export"
    assert train.main(["--out", str(straight), "--steps", "4", "--export-on-finish", str(export),
                       "--export-dtype", "fp32"] + common) == 0
    err = capsys.readouterr().err
    assert "packing whole" in err and "packing      whole: " in err and " 0 of " in err
    assert train.main(["--out", str(split), "--steps", "4", "--save-every", "2"] + common) == 0
    capsys.readouterr()
    assert train.main(["--resume", str(split / "checkpoints" / "step-00000002"), "--out", str(tmp_path / "resumed"),
                       "--progress", "none"]) == 0
    losses = [[r["loss"] for r in metrics.read_metrics(os.path.join(out, "metrics.jsonl"))]
              for out in (straight, tmp_path / "resumed")]
    assert losses[1] == losses[0][2:]
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["packing"]["mode"] == "whole" and summary["packing"]["rows"] == 8
    assert 0 < summary["packing"]["padding_fraction"] < 1
    # The held-out conversations scored one by one by transformers, on the exported weights.
    tok = tokenizers.load(chat_model)
    model = AutoModelForCausalLM.from_pretrained(str(export), torch_dtype=torch.float32).eval()
    total, count, right = 0.0, 0, 0
    for ids, labels in Corpus((held,), tok).documents():
        sep_label = tok.separator_id if labels[-1] != IGNORE else IGNORE
        x = torch.tensor([ids.tolist() + [tok.separator_id]])
        y = torch.tensor(labels.tolist() + [sep_label])
        with torch.no_grad():
            logits = model(x).logits[0, :-1].double()
        total += float(torch.nn.functional.cross_entropy(logits, y[1:], ignore_index=IGNORE, reduction="sum"))
        count += int((y[1:] != IGNORE).sum())
        right += int(((logits.argmax(-1) == y[1:]) & (y[1:] != IGNORE)).sum())
    assert summary["eval_tokens"] == count
    assert abs(summary["eval_loss"] - total / count) < 1e-5
    assert summary["eval_token_accuracy"] == right / count  # argmax == label over the labelled tokens
    rows = metrics.read_metrics(str(straight / "metrics.jsonl"))
    assert all(0 <= r["token_accuracy"] <= 1 for r in rows) and rows[-1]["eval_token_accuracy"] == right / count


def test_epoch_counts_the_documents_trained_by_hand_before_and_after_a_resume(chat_model, tmp_path, capsys):
    # 5 documents of 29 tokens and 5 of 9 (30 and 10 with the separator), in corpus order, packed whole
    # best-fit-decreasing into rows of 64: [a0 a1], [a2 a3], [a4 b0 b1 b2], [b3 b4]; 2 rows a step. The whole
    # epoch is read into one packing window before the first row, but epoch counts the documents whose rows were
    # trained: 4 of 10 after step 1, all 10 after step 2, then 4 more.
    rng = np.random.default_rng(0)
    paths = [str(tmp_path / "a.npy"), str(tmp_path / "b.npy")]
    np.save(paths[0], rng.integers(10, 250, size=(5, 29)))
    np.save(paths[1], rng.integers(10, 250, size=(5, 9)))
    common = ["--model", chat_model, "--data", *paths, "--packing", "whole", "--no-shuffle", "--seq-len", "64"] + FAST
    straight, split, resumed = tmp_path / "straight", tmp_path / "split", tmp_path / "resumed"
    assert train.main(["--out", str(straight), "--steps", "3"] + common) == 0, capsys.readouterr().err
    assert [r["epoch"] for r in metrics.read_metrics(str(straight / "metrics.jsonl"))] == [0.4, 1.0, 1.4]
    assert json.loads((straight / "summary.json").read_text())["epoch"] == 1.4
    assert train.main(["--out", str(split), "--steps", "3", "--save-every", "1"] + common) == 0
    assert train.main(["--resume", str(split / "checkpoints" / "step-00000001"), "--out", str(resumed),
                       "--progress", "none"]) == 0, capsys.readouterr().err
    assert [r["epoch"] for r in metrics.read_metrics(str(resumed / "metrics.jsonl"))] == [1.0, 1.4]
