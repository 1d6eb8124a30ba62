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
    reclaimed = {_fake(tmp_path, host, dead), _fake(tmp_path, host, _dead_pid(), owner=False)}
    # The pid of a running process whose start time differs from the recorded one: reused, the owner is gone.
    reclaimed.add(_fake(tmp_path, host, os.getppid(), start=(spill_dirs.process_start(os.getppid()) or 0) + 1))
    kept = {
        _fake(tmp_path, host, os.getpid(), start=spill_dirs.process_start(os.getpid())),  # a live owner
        _fake(tmp_path, host, os.getppid()),  # a live owner, start time unknown
        _fake(tmp_path, "another_host", dead),  # another machine's: cannot tell, never touched
    }
    (tmp_path / "megatrain-spill-legacy").mkdir()  # not named by owner: never touched
    (tmp_path / "user-file.bin").write_bytes(b"mine")
    kept |= {"megatrain-spill-legacy", "user-file.bin"}
    plan = Plan(spill="optimizer", spill_dir=str(tmp_path), io_backend="posix")
    with pytest.warns(UserWarning, match=r"removed 3 spill directories .* no longer running") as record:
        engine = Engine(CONFIG, plan=plan, compute_dtype=torch.float32, device="cpu")
    message = str(record[0].message)
    assert all(name in message for name in reclaimed) and "\n" not in message
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
