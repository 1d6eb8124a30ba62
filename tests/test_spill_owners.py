"""Spill directories carry their owner (host, pid); a later run reclaims dead owners' ones and says so."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from megatrain.runtime import Engine, ModelConfig, Plan
from megatrain.runtime.spill import spill_dirs

CONFIG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _fake(spill_dir, host: str, pid: int, start: int | None = None, owner: bool = True) -> str:
    path = spill_dir / f"megatrain-spill-{host}-pid{pid}-{len(os.listdir(spill_dir))}x"
    path.mkdir()
    (path / "exp_avg.bin").write_bytes(b"\0" * 8192)
    if owner:
        (path / "owner.json").write_text(json.dumps({"host": host, "pid": pid, "start": start}))
    return path.name


def test_dead_owners_are_reclaimed_live_and_foreign_ones_kept(tmp_path) -> None:
    host, dead = spill_dirs.host_name(), _dead_pid()
    reclaimed = {_fake(tmp_path, host, dead)}
    # The pid of a running process whose start time differs from the recorded one: reused, the owner is gone.
    reclaimed.add(_fake(tmp_path, host, os.getppid(), start=(spill_dirs.process_start(os.getppid()) or 0) + 1))
    kept = {
        _fake(tmp_path, host, os.getpid(), start=spill_dirs.process_start(os.getpid())),  # a live owner
        _fake(tmp_path, host, os.getppid()),  # a live owner, start time unknown
        _fake(tmp_path, "another_host", dead),  # another machine's: cannot tell, never touched
    }
    unrecorded = _fake(tmp_path, host, _dead_pid(), owner=False)  # no ownership record: not known to be ours
    kept.add(unrecorded)
    (tmp_path / "megatrain-spill-legacy").mkdir()  # not named by owner: never touched
    (tmp_path / "user-file.bin").write_bytes(b"mine")
    kept |= {"megatrain-spill-legacy", "user-file.bin"}
    plan = Plan(spill="optimizer", spill_dir=str(tmp_path), io_backend="posix")
    with pytest.warns(UserWarning, match=r"removed 2 spill directories .* no longer running") as record:
        engine = Engine(CONFIG, plan=plan, compute_dtype=torch.float32, device="cpu")
    message = str(record[0].message)
    assert all(name in message for name in reclaimed) and "\n" not in message
    assert unrecorded not in message and unrecorded in str(record[1].message)
    with engine:
        own = set(os.listdir(tmp_path)) - kept
        assert len(own) == 1, own
        (name,) = own
        assert name.startswith(f"megatrain-spill-{spill_dirs.host_name()}-pid{os.getpid()}-")
        owner = json.loads((tmp_path / name / "owner.json").read_text())
        assert owner["pid"] == os.getpid() and owner["start"] == spill_dirs.process_start(os.getpid())
        assert sorted(os.listdir(tmp_path / name)) == ["exp_avg.bin", "exp_avg_sq.bin", "owner.json"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second engine in this process leaves the first one's files alone
            with Engine(CONFIG, plan=plan, compute_dtype=torch.float32, device="cpu"):
                assert name in os.listdir(tmp_path)
    assert set(os.listdir(tmp_path)) == kept
    assert (tmp_path / "user-file.bin").read_bytes() == b"mine"


def test_a_killed_runs_spill_directory_is_reclaimed_by_the_next_run(tmp_path) -> None:
    code = ("import os, torch; from megatrain.runtime import Engine, ModelConfig, Plan; "
            f"c = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1, "
            "num_attention_heads=2); "
            f"e = Engine(c, plan=Plan(spill='all', spill_dir={str(tmp_path)!r}, io_backend='posix'), "
            "compute_dtype=torch.float32, device='cpu'); os._exit(0)")  # exits without close(): as if killed
    subprocess.run([sys.executable, "-c", code], check=True)
    (left,) = os.listdir(tmp_path)
    plan = Plan(spill="all", spill_dir=str(tmp_path), io_backend="posix")
    with pytest.warns(UserWarning, match=f"removed 1 spill directory.*{left}"):
        with Engine(CONFIG, plan=plan, compute_dtype=torch.float32, device="cpu"):
            assert left not in os.listdir(tmp_path)
    assert os.listdir(tmp_path) == []


def test_a_folder_named_like_ours_without_our_record_is_kept_and_said_once(tmp_path) -> None:
    host = spill_dirs.host_name()
    mine = tmp_path / f"megatrain-spill-{host}-pid{_dead_pid()}-mine"
    mine.mkdir()
    (mine / "thesis.txt").write_text("four years of work")
    foreign = tmp_path / f"megatrain-spill-{host}-pid{_dead_pid()}-copied"  # a record naming another machine
    foreign.mkdir()
    (foreign / "owner.json").write_text(json.dumps({"host": "elsewhere", "pid": int(foreign.name.split("pid")[1]
                                                                                         .split("-")[0])}))
    plan = Plan(spill="all", spill_dir=str(tmp_path), io_backend="posix")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with Engine(CONFIG, plan=plan, compute_dtype=torch.float32, device="cpu"):
            pass
        with Engine(CONFIG, plan=plan, compute_dtype=torch.float32, device="cpu"):
            pass  # said once, not again by the next engine
    messages = [str(w.message) for w in record]
    assert len(messages) == 1 and "\n" not in messages[0], messages
    assert mine.name in messages[0] and foreign.name in messages[0] and "without megatrain's owner.json" in messages[0]
    assert (mine / "thesis.txt").read_text() == "four years of work"
    assert sorted(os.listdir(tmp_path)) == sorted([mine.name, foreign.name])


def test_megatrain_train_keeps_the_folder_and_says_so_in_one_line(tmp_path, capsys) -> None:
    from megatrain.tools import train
    spill = tmp_path / "spill"
    mine = spill / f"megatrain-spill-{spill_dirs.host_name()}-pid{_dead_pid()}-mine"
    mine.mkdir(parents=True)
    (mine / "thesis.txt").write_text("four years of work")
    assert train.main(["--out", str(tmp_path / "run"), "--steps", "1", "--seq-len", "32", "--batch", "2",
                       "--progress", "none", "--no-plot", "--spill", "all", "--spill-dir", str(spill)]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if mine.name in line]
    assert len(lines) == 1 and lines[0].startswith("megatrain-train: warning: left 1 folder(s)"), err
    assert "UserWarning" not in err and "warnings.warn" not in err and ".py:" not in err
    assert (mine / "thesis.txt").read_text() == "four years of work" and os.listdir(spill) == [mine.name]
