"""The start-up tokenizer check (tools/tokenizer_check.py): refused, in one line naming --tokenizer, when
transformers' AutoTokenizer builds another tokenizer from the model directory; a chat template's generation
blocks checked against transformers' assistant masks."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megatrain.tools import tokenizer_check, train
from megatrain.tools.tokenizer import HFTokenizer
from megatrain.tools.train_config import TrainConfigError

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from chat_model import RECORDS, write_model, write_tokenizer  # noqa: E402

ARGS = ["--seq-len", "32", "--batch", "2", "--steps", "1", "--progress", "none", "--no-plot", "--warmup-steps", "1",
        "--compute-dtype", "fp32"]


def _lowercasing(directory: str) -> str:
    """A hand-made tokenizer.json that lowercases, whose tokenizer_config.json names Qwen2Tokenizer: transformers
    builds that class's own tokenizer from the vocabulary (no lowercasing), not the file's."""
    from tokenizers import Tokenizer, normalizers

    write_tokenizer(directory)
    path = os.path.join(directory, "tokenizer.json")
    tok = Tokenizer.from_file(path)
    tok.normalizer = normalizers.Lowercase()
    tok.save(path)
    config_path = os.path.join(directory, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**config, "tokenizer_class": "Qwen2Tokenizer"}, f)
    return directory


@pytest.fixture()
def chat_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS * 4) + "\n")
    return str(path)


def test_a_tokenizer_transformers_builds_otherwise_is_refused_unless_chosen(tmp_path, chat_file, capsys):
    model = write_model(_lowercasing(str(tmp_path / "model")), vocab_size=300)
    from transformers import AutoTokenizer  # the premise: transformers really builds another tokenizer here

    assert AutoTokenizer.from_pretrained(model).encode("Name", add_special_tokens=False) != \
        HFTokenizer(model).encode("Name")
    out = tmp_path / "run"
    capsys.readouterr()
    assert train.main(["--model", model, "--data", chat_file, "--out", str(out)] + ARGS) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "AutoTokenizer builds another tokenizer" in err[0], err
    assert f"--tokenizer {os.path.join(model, 'tokenizer.json')}" in err[0] and not out.exists()
    # The tokenizer chosen explicitly is the user's choice: trained as written.
    assert train.main(["--model", model, "--tokenizer", os.path.join(model, "tokenizer.json"), "--data", chat_file,
                       "--out", str(out)] + ARGS) == 0


def test_an_agreeing_tokenizer_is_compared_and_passes(tmp_path, chat_file, monkeypatch):
    model = write_model(write_tokenizer(str(tmp_path / "model")), vocab_size=300)
    compared: list[str] = []
    auto = tokenizer_check._auto_tokenizer

    def counting(directory):
        hf = auto(directory)
        encode = hf.encode
        hf.encode = lambda text, **kw: (compared.append(text), encode(text, **kw))[1]
        return hf

    monkeypatch.setattr(tokenizer_check, "_auto_tokenizer", counting)
    assert train.main(["--model", model, "--data", chat_file, "--out", str(tmp_path / "run")] + ARGS) == 0
    assert len(compared) >= len(RECORDS)  # every sampled document's text, encoded by both


def test_generation_blocks_are_checked_against_transformers_assistant_masks(tmp_path, chat_file):
    from transformers import AutoTokenizer

    directory = write_tokenizer(str(tmp_path / "tok"))
    tokenizer, hf = HFTokenizer(directory), AutoTokenizer.from_pretrained(directory)
    tokenizer_check._check_masks(tokenizer, hf, (chat_file,), directory, "--tokenizer")  # they agree

    class ShiftedMasks:  # transformers marking the token after each one the template marks
        def apply_chat_template(self, messages, **kwargs):
            out = hf.apply_chat_template(messages, **kwargs)
            return {"input_ids": out["input_ids"], "assistant_masks": [0] + list(out["assistant_masks"])[:-1]}

    with pytest.raises(TrainConfigError, match=r"generation blocks .* mark other assistant tokens .*chat.jsonl "
                                               r"line 1\); .*--tokenizer") as e:
        tokenizer_check._check_masks(tokenizer, ShiftedMasks(), (chat_file,), directory, "--tokenizer")
    assert "\n" not in str(e.value)
    masks = [np.asarray(hf.apply_chat_template(r["messages"], tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)["assistant_masks"])
             for r in RECORDS if "messages" in r]
    assert all(m.any() for m in masks)  # the sample has assistant tokens to compare
