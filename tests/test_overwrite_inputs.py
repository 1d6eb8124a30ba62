"""``megatrain-train --overwrite`` never deletes what the run reads: every input that lies in the earlier run's
files (``run_dir.RUN_FILES``) is refused in one line, exit 2, before anything is deleted.

Each case runs the command in-process (``train.main``: the refusal is the command's, its status the process's exit
status; tests/test_train_fuzz.py runs the installed command) and checks every file under the test's directory byte
for byte afterwards.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from megatrain.tools import train

from test_train_runs import FAST, snapshot, tiny_config


def earlier_run(root) -> str:
    """A run directory as an earlier run left it: its checkpoints/ and metrics.jsonl."""
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    return str(run)


def refused(tmp_path, capsys, args: list[str]) -> str:
    """Run the command, check it refused in one line with status 2 and changed no file; the line."""
    before = snapshot(tmp_path)
    capsys.readouterr()
    status = train.main([*FAST, "--steps", "2", "--overwrite", *args])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.count("\n") == 1 and err.startswith("megatrain-train: error: overwrite: "), err
    assert "Traceback" not in err
    assert snapshot(tmp_path) == before  # every input (and the earlier run) byte for byte as it was
    return err


def data_file(path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    return str(path)


@pytest.mark.parametrize("flag", ["--data", "--eval-data", "--model", "--tokenizer", "--plan", "--config"])
def test_an_input_inside_the_runs_files_is_refused_and_kept(tmp_path, capsys, flag):
    run = earlier_run(tmp_path)
    inside = os.path.join(run, "checkpoints")
    outside_data = data_file(tmp_path / "corpus.txt")
    args = ["--out", run]
    if flag == "--data":
        target = data_file(tmp_path / "run" / "checkpoints" / "mydata.txt")
        args += ["--data", target]
    elif flag == "--eval-data":
        target = data_file(tmp_path / "run" / "checkpoints" / "held_out.txt")
        args += ["--data", outside_data, "--eval-data", target]
    elif flag == "--model":
        target = os.path.join(inside, "mymodel")
        os.makedirs(target)
        with open(os.path.join(target, "config.json"), "w") as f:
            json.dump(tiny_config(), f)
        args += ["--model", target, "--init", "random"]
    elif flag == "--tokenizer":
        target = os.path.join(inside, "tokenizer.json")
        with open(target, "w") as f:
            f.write('{"version": "1.0"}')
        args += ["--tokenizer", target]
    elif flag == "--plan":
        target = os.path.join(inside, "plan.json")
        with open(target, "w") as f:
            f.write("{}")
        args += ["--plan", target]
    else:
        target = os.path.join(inside, "run.toml")
        with open(target, "w") as f:
            f.write('steps = 2\n')
        args += ["--config", target]
    line = refused(tmp_path, capsys, args)
    assert f"{flag} {target} is inside {inside}" in line and "choose another --out" in line


def test_a_resumed_checkpoint_inside_the_runs_files_is_refused_and_kept(tmp_path, capsys):
    first = tmp_path / "first"
    assert train.main(["--out", str(first), *FAST, "--steps", "2", "--save-every", "2"]) == 0
    run = earlier_run(tmp_path)
    kept = os.path.join(run, "checkpoints", "old")  # not the run's own checkpoints: --overwrite would delete it
    shutil.copytree(first / "checkpoints", kept)
    line = refused(tmp_path, capsys, ["--out", run, "--resume", kept, "--steps", "4"])
    assert f"--resume {os.path.join(kept, 'step-00000002')} is inside" in line


def test_an_input_through_a_symlink_or_holding_the_run_is_refused(tmp_path, capsys):
    run = earlier_run(tmp_path)
    data_file(tmp_path / "run" / "checkpoints" / "mydata.txt")
    os.symlink(os.path.join(run, "checkpoints", "mydata.txt"), tmp_path / "link.txt")
    line = refused(tmp_path, capsys, ["--out", run, "--data", str(tmp_path / "link.txt")])
    assert "link.txt is inside" in line
    with open(os.path.join(run, "config.json"), "w") as f:  # the model directory is the run directory itself
        json.dump(tiny_config(), f)
    line = refused(tmp_path, capsys, ["--out", run, "--model", run, "--init", "random"])
    assert f"--model {run} holds" in line


def test_inputs_beside_the_runs_files_still_overwrite(tmp_path, capsys):
    """An input in --out but outside the run's own files is read and kept; the earlier run's files go."""
    run = earlier_run(tmp_path)
    data = data_file(tmp_path / "run" / "mydata.txt")
    assert train.main(["--out", run, *FAST, "--steps", "2", "--overwrite", "--data", data]) == 0
    with open(data) as f:
        assert f.read() == "The quick brown fox jumps over the lazy dog. " * 40
    assert "deleted the earlier run's metrics.jsonl, checkpoints" in capsys.readouterr().err
