"""Batches with nothing to learn: a conversation whose prompt alone fills a row, or with no assistant turn, is
dropped before packing and counted (summary.json's packing figures, the summary's packing line), never met at
step time; with nothing trainable left the run stops in one line before --out is written. Any error before
step 1 leaves --out as it found it."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from megatrain.runtime import Engine
from megatrain.runtime.errors import InputError
from megatrain.tools import packing, train

FAST = ["--seq-len", "32", "--batch", "1", "--progress", "none", "--no-plot", "--no-shuffle", "--steps", "2"]
LONG_PROMPT = {"messages": [{"role": "user", "content": "why " * 40}, {"role": "assistant", "content": "ok"}]}
NO_ANSWER = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
GOOD = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


def _data(tmp_path, records) -> str:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.parametrize("existing", [False, True])
def test_nothing_trainable_is_one_line_before_out_is_written(tmp_path, capsys, existing):
    data = _data(tmp_path, [LONG_PROMPT, NO_ANSWER] * 3)
    before = _sha(data)
    out = tmp_path / "run"
    if existing:
        out.mkdir()
    assert train.main(["--data", data, "--out", str(out)] + FAST) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("megatrain-train: error: data: none of the 6 training documents has a token to learn"), err
    assert "--packing whole" in err and "first 32 tokens" in err
    assert (os.listdir(out) == []) if existing else not out.exists()
    assert _sha(data) == before


def test_conversations_with_nothing_to_learn_are_dropped_and_counted(tmp_path, capsys):
    """The first document alone in the first row would make step 1's batch all -100: it is dropped instead."""
    data = _data(tmp_path, [LONG_PROMPT, NO_ANSWER, GOOD, GOOD])
    out = tmp_path / "run"
    assert train.main(["--data", data, "--out", str(out)] + FAST) == 0
    err = capsys.readouterr().err
    packed = json.loads((out / "summary.json").read_text())["packing"]
    assert packed["dropped"] >= 2 and packed["dropped"] % 2 == 0, packed  # both, once per epoch read
    assert f"{packed['dropped']:,} dropped (nothing to learn" in err, err


@pytest.mark.parametrize("labels, seq_len, mode, expected", [
    ([-100, -100, -100, 5], 8, "whole", True),
    ([-100, -100, -100, 5], 3, "whole", False),   # the prompt fills the first row
    ([-100, -100, -100, 5], 3, "none", False),
    ([-100, -100, -100, 5], 3, "concat", True),   # continued into the next row, which learns it
    ([-100, -100, -100, -100], 8, "documents", False),  # no assistant turn
    ([7, -100, -100, -100], 8, "whole", False),   # the first token of a row is never predicted
])
def test_learnable(labels, seq_len, mode, expected):
    ids = np.arange(len(labels), dtype=np.int64)
    assert packing.learnable((ids, np.array(labels, dtype=np.int64)), seq_len, mode) is expected
    assert packing.learnable(ids, seq_len, mode)  # plain text: its labels are its tokens


@pytest.mark.parametrize("existing", [False, True])
def test_an_error_at_step_1_leaves_out_as_it_found_it(tmp_path, capsys, monkeypatch, existing):
    def refused(self, *args, **kwargs):
        raise InputError("refused for the test")

    monkeypatch.setattr(Engine, "step", refused)
    out = tmp_path / "run"
    if existing:
        out.mkdir()
    assert train.main(["--out", str(out), "--spill", "optimizer"] + FAST) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "megatrain-train: error: refused for the test", err
    assert (os.listdir(out) == []) if existing else not out.exists()
