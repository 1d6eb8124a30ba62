"""One line per warning: a checkpoint that cannot be written, and a chat record with a role no template knows."""
from __future__ import annotations

import json

from megatrain.runtime.io import checkpoint_format
from megatrain.tools import train

FAST = ["--seq-len", "32", "--batch", "2", "--progress", "none", "--no-plot", "--warmup-steps", "1",
        "--compute-dtype", "fp32"]
DISK_FULL = ValueError('RESOURCE_EXHAUSTED: Error writing local file "c/0": No space left on device [OS error: 28]')


def test_a_checkpoint_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys):
    real, calls = checkpoint_format.write_array, []

    def full_once(arr, t):  # the first write of the run fails (the step-2 checkpoint), the rest go ahead
        calls.append(1)
        if len(calls) == 1:
            raise DISK_FULL
        return real(arr, t)

    monkeypatch.setattr(checkpoint_format, "write_array", full_once)
    assert train.main(["--out", str(tmp_path / "run"), "--steps", "4", "--save-every", "2"] + FAST) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "disk is full" in line]
    assert len(lines) == 1 and lines[0].startswith("megatrain-train: warning: "), err
    assert "RuntimeWarning" not in err and "save_checkpoint(" not in err and ".py:" not in err


def test_a_chat_record_with_an_unknown_role_is_refused_naming_it(tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data.write_text("\n".join(json.dumps(r) for r in [good] * 20 + [bad]) + "\n")
    assert train.main(["--out", str(tmp_path / "run"), "--data", str(data), "--no-shuffle"] + FAST) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{data} line 21: unknown role 'human'" in err, err
