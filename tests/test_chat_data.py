"""Chat records (tools/chat_data.py): token ids and label masks equal transformers' apply_chat_template, packed
with their labels, and trained on end to end by megatrain-train."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megatrain.runtime import Engine
from megatrain.tools import chat_data, packing, tokenizer as tokenizers, train
from megatrain.tools.data import Corpus
from megatrain.tools.train_config import TrainConfigError

from chat_model import CHAT_TEMPLATE, PLAIN_CHATML, RECORDS, write_model, write_tokenizer

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")

IGNORE = packing.IGNORE_INDEX


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(str(tmp_path_factory.mktemp("tok")))


def hf_reference(tok_dir: str, record: dict) -> tuple[list[int], list[int]]:
    """transformers' ids and mask of one record (TRL's rule for prompt/completion: tokens after the prompt's)."""
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    if "messages" in record:
        out = hf.apply_chat_template(record["messages"], tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        return list(out["input_ids"]), list(out["assistant_masks"])
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str):
        prompt_ids = hf(prompt, add_special_tokens=False)["input_ids"]
        ids = hf(prompt + completion, add_special_tokens=False)["input_ids"]
    else:
        prompt_ids = hf.apply_chat_template(prompt, tokenize=True, return_dict=True,
                                            add_generation_prompt=True)["input_ids"]
        ids = hf.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"]
    assert ids[:len(prompt_ids)] == prompt_ids
    return list(ids), [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))


@pytest.mark.parametrize("index", range(len(RECORDS)))
def test_ids_and_labels_equal_transformers_apply_chat_template(tok_dir, index):
    record = RECORDS[index]
    ids, mask = hf_reference(tok_dir, record)
    assert sum(mask) and not all(mask)  # the reference labels some tokens and masks others
    fmt = chat_data.ChatFormat(tokenizers.load(os.path.join(tok_dir, "tokenizer.json")))
    got_ids, got_labels = fmt.encode(record, "test")
    assert got_ids.tolist() == ids
    assert got_labels.tolist() == [i if m else IGNORE for i, m in zip(ids, mask)]
    all_ids, all_labels = chat_data.ChatFormat(fmt.tokenizer, "all").encode(record, "test")
    assert all_ids.tolist() == ids and all_labels.tolist() == ids


def test_a_template_without_generation_blocks_labels_each_assistant_turn(tok_dir, tmp_path):
    """Without {% generation %}: the assistant's turn as the template renders it (its text, end marker and the
    newline the template puts after the turn)."""
    plain = write_tokenizer(str(tmp_path / "plain"), template=PLAIN_CHATML)
    with_blocks = chat_data.ChatFormat(tokenizers.load(tok_dir))
    without = chat_data.ChatFormat(tokenizers.load(plain))
    assert without.template is not None and not without.has_generation_blocks
    hf = transformers.AutoTokenizer.from_pretrained(plain)
    assistant_first = {"messages": [{"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "Hi"}]}
    for record in RECORDS[:2] + [assistant_first]:
        (ids, blocks), (same_ids, labels) = with_blocks.encode(record, "t"), without.encode(record, "t")
        assert ids.tolist() == same_ids.tolist()
        extra = (labels != IGNORE) & (blocks == IGNORE)
        assert ((blocks != IGNORE) <= (labels != IGNORE)).all() and extra.any()
        assert set(hf.decode([i]) for i in ids[extra].tolist()) == {"\n"}


def test_plain_format_without_a_template_labels_the_assistant_content():
    fmt = chat_data.ChatFormat(tokenizers.ByteTokenizer())
    assert fmt.template is None
    ids, labels = fmt.encode({"messages": [{"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": "yo"}]}, "t")
    assert bytes(ids.tolist()).decode() == "<|user|>\nhi\n<|assistant|>\nyo\n"
    assert bytes(i for i in labels.tolist() if i != IGNORE).decode() == "yo\n"


def test_bad_records_are_one_line(tok_dir):
    fmt = chat_data.ChatFormat(tokenizers.load(tok_dir))
    for record, fragment in [({"messages": "hello"}, "messages must be a list"),
                             ({"messages": [{"content": "x"}]}, "messages must be a list"),
                             ({"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}, "both")]:
        with pytest.raises(TrainConfigError, match=fragment) as e:
            fmt.encode(record, "f.jsonl line 3")
        assert "f.jsonl line 3" in str(e.value) and "\n" not in str(e.value)
    refusing = chat_data.compile_template("{{ raise_exception('only user and assistant roles') }}")
    fmt.template = refusing
    with pytest.raises(TrainConfigError, match="only user and assistant roles"):
        fmt.encode(RECORDS[1], "t")


def test_labels_travel_through_packing_and_the_separator_follows_the_last_token():
    docs = [(np.array([1, 2, 3]), np.array([IGNORE, 2, 3])),   # ends in an answer: SEP trained
            (np.array([4, 5]), np.array([4, IGNORE])),          # ends in a prompt: SEP ignored
            np.array([6, 7])]                                   # plain text: every label
    rows = list(packing.pack(iter(docs), 4, separator_id=9))
    ids = np.concatenate([r[0] for r in rows]).tolist()
    labels = np.concatenate([r[1] for r in rows]).tolist()
    assert ids == [1, 2, 3, 9, 4, 5, 9, 6, 7, 9, 9, 9]
    assert labels == [IGNORE, 2, 3, 9, 4, IGNORE, IGNORE, 6, 7, 9, IGNORE, IGNORE]


def test_corpus_reads_chat_jsonl_and_parquet(tok_dir, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    tok = tokenizers.load(tok_dir)
    fmt = chat_data.ChatFormat(tok)
    expected = [fmt.encode(r, "t") for r in RECORDS]
    got = list(Corpus((str(path),), tok).documents())
    assert [(a.tolist(), b.tolist()) for a, b in got] == [(a.tolist(), b.tolist()) for a, b in expected]
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.Table.from_pylist([{"messages": r["messages"]} for r in RECORDS[:2]]), tmp_path / "c.parquet")
    got = list(Corpus((str(tmp_path / "c.parquet"),), tok).documents())
    assert [(a.tolist(), b.tolist()) for a, b in got] == [(a.tolist(), b.tolist()) for a, b in expected[:2]]


def test_megatrain_train_fine_tunes_a_model_directory_on_chat_data(tmp_path, capsys):
    model = write_model(write_tokenizer(str(tmp_path / "model")), vocab_size=300)
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS * 8) + "\n")
    out = tmp_path / "run"
    argv = ["--model", model, "--data", str(data),  # the tokenizer: the model directory's by default
            "--out", str(out), "--seq-len", "64", "--batch", "2", "--steps", "3", "--progress", "none", "--no-plot",
            "--warmup-steps", "1", "--compute-dtype", "fp32", "--no-shuffle"]  # corpus order: counted below
    assert train.main(argv) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in rows)
    # Only the assistant's tokens are trained on: the step's labelled tokens, counted from the packed rows
    # (chat data: whole documents, by default).
    tok = tokenizers.load(model)
    labels = [r.labels for r in packing.pack(Corpus((str(data),), tok).documents(), 64, tok.separator_id,
                                             mode="whole")]
    expected = sum(int((row[1:] != IGNORE).sum()) for row in labels[:6])
    assert rows[-1]["trained_tokens"] == expected < 3 * 2 * 63 and rows[-1]["tokens"] == 3 * 2 * 64
    engine = Engine.load_checkpoint(str(out / "checkpoints"))
    saved = engine.checkpoint_extra["train_config"]
    engine.close()
    assert saved["tokenizer"] == os.path.join(model, "tokenizer.json") and saved["train_on"] == "completion"
    # train_on is part of the run: a resume cannot change it.
    capsys.readouterr()
    assert train.main(["--resume", str(out), "--steps", "4", "--train-on", "all", "--progress", "none"]) == 2
    assert "train_on cannot change" in capsys.readouterr().err


@pytest.mark.parametrize("content", [5, None, {"text": "hi"}])
def test_content_that_is_not_a_string_is_refused_naming_file_and_line(tmp_path, capsys, content):
    data = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]}
    data.write_text("\n".join(json.dumps(r) for r in [good] * 20 + [bad]) + "\n")
    out = tmp_path / "run"
    assert train.main(["--out", str(out), "--data", str(data), "--no-shuffle", "--steps", "2", "--seq-len", "32",
                       "--batch", "2", "--progress", "none", "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{data} line 21: the assistant message's content in messages" in err, err
    assert f"is {json.dumps(content)}, not a string" in err and not out.exists()
