"""A run killed before its first step finished leaves its record (run.json), an empty metrics.jsonl and its lock:
the plain re-run recognises them as its own and replaces them; anything else in --out keeps it refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from megatrain.tools import train

from test_train_runs import FAST, one_error_line, snapshot, steps_of

KILLED_AT_STEP_1 = ("import os, sys; from megatrain.runtime import Engine; from megatrain.tools import train; "
                    "Engine.step = lambda *a, **k: os._exit(9); "  # SIGKILL-like: no clean-up runs
                    "train.main(sys.argv[1:])")


def killed_run(out, *args: str) -> None:
    done = subprocess.run([sys.executable, "-c", KILLED_AT_STEP_1, "--out", str(out), *FAST, *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 9, done.stderr
    assert sorted(os.listdir(out)) == ["megatrain.lock", "metrics.jsonl", "run.json"]
    assert os.path.getsize(out / "metrics.jsonl") == 0


def test_a_run_killed_before_its_first_step_runs_again_plainly(tmp_path, capsys):
    out = tmp_path / "run"
    killed_run(out, "--steps", "2")
    assert train.main(["--out", str(out), *FAST, "--steps", "2"]) == 0
    assert steps_of(out) == [1, 2] and os.path.isdir(out / "checkpoints")


def test_other_leftovers_keep_the_directory_refused(tmp_path, capsys):
    out = tmp_path / "run"
    killed_run(out, "--steps", "2")
    capsys.readouterr()
    before = snapshot(tmp_path)
    assert train.main(["--out", str(out), *FAST, "--steps", "2", "--seed", "7"]) == 2  # another run's record
    assert "already holds" in one_error_line(capsys) and snapshot(tmp_path) == before
    (out / "notes.txt").write_text("mine")  # a file of the user's beside the leftovers
    before = snapshot(tmp_path)
    assert train.main(["--out", str(out), *FAST, "--steps", "2"]) == 2
    assert "already holds" in one_error_line(capsys) and snapshot(tmp_path) == before
    os.remove(out / "notes.txt")
    with open(out / "metrics.jsonl", "w") as f:  # a metrics row: the run trained a step
        f.write(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    before = snapshot(tmp_path)
    assert train.main(["--out", str(out), *FAST, "--steps", "2"]) == 2
    assert "already holds" in one_error_line(capsys) and snapshot(tmp_path) == before
