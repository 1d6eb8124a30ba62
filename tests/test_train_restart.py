"""megatrain-train --resume-or-start: the same command starts a run, continues it after a restart (torchrun
--max-restarts, a scheduler's requeue) and refuses a directory that holds another run."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from cli_ranks import ENV, TINY, TORCHRUN, TRAIN, close, here, losses, ok_here
from megatrain.tools import restart

RUN = ["--batch", "4", "--save-every", "2", "--resume-or-start"]


# The command's decisions (start, continue, refuse, done) run in-process (cli_ranks.here): their status is the
# process's exit status. The killed rank's restart is torchrun's, in processes.
def test_start_then_continue_then_refuse_another_run(tmp_path, capsys):
    out = str(tmp_path / "run")
    ok_here(capsys, "--out", out, *RUN, "--steps", "2")
    err = ok_here(capsys, "--out", out, *RUN, "--steps", "3")
    assert "resumed from" in err and "step-00000002" in err, err
    assert sorted(losses(out)) == [1, 2, 3]
    status, err = here(capsys, "--out", out, *RUN, "--steps", "4", "--seed", "1")
    assert status == 2 and err.count("\n") == 1, err
    assert "holds another run (seed 0, not 1)" in err
    assert sorted(losses(out)) == [1, 2, 3]  # untouched


def test_a_requeued_run_that_had_finished_exits_0_saying_so(tmp_path, capsys):
    out = str(tmp_path / "run")
    ok_here(capsys, "--out", out, *RUN, "--steps", "2")
    before = {name: os.path.getmtime(os.path.join(out, name)) for name in os.listdir(out)}
    status, err = here(capsys, "--out", out, *RUN, "--steps", "2")
    assert status == 0, err
    assert err.count("\n") == 1 and "already done" in err and "step 2 of 2" in err, err
    assert {name: os.path.getmtime(os.path.join(out, name)) for name in os.listdir(out)} == before  # untouched
    assert sorted(losses(out)) == [1, 2]
    status, err = here(capsys, "--resume", out, "--steps", "2", *RUN[:4])  # an explicit --resume still asks for more
    assert status == 2 and "raise --steps" in err, err


def test_a_run_that_stopped_before_its_first_checkpoint_starts_over(tmp_path, capsys):
    out = str(tmp_path / "run")
    ok_here(capsys, "--out", out, *RUN, "--steps", "1", "--save-every", "0")
    for name in ("checkpoints", "summary.json"):  # as if it had died after its first step
        path = os.path.join(out, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    assert restart.latest_checkpoint(out) is None
    err = ok_here(capsys, "--out", out, *RUN, "--steps", "2")
    assert "trained steps 1-2" in err, err
    assert sorted(losses(out)) == [1, 2]
    foreign = str(tmp_path / "foreign")
    os.makedirs(foreign)
    open(os.path.join(foreign, "notes.txt"), "w").close()
    status, err = here(capsys, "--out", foreign, *RUN, "--steps", "2")
    assert status == 2 and "already holds" in err, err


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of the worker torchrun (``parent``) started with RANK=rank."""
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return int(pid)
        except (OSError, ValueError, IndexError):
            continue
    return None


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not on PATH")
def test_a_killed_rank_restarts_and_the_run_finishes_as_if_uninterrupted(tmp_path, capsys):
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    # The uninterrupted run in one process: two ranks train its losses (test_train_ranks.py), within the same bound.
    ok_here(capsys, "--out", whole, *RUN, "--steps", "6")
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", TRAIN, *TINY, "--out", killed,
           *RUN, "--steps", "6"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 240
    victim = None
    while victim is None and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
        if os.path.exists(os.path.join(killed, "metrics.jsonl")) and 3 in losses(killed):  # past the step-2 save
            victim = _rank_pid(proc.pid, 1)
    assert victim is not None, "the run ended before a rank could be killed"
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    with open(os.path.join(str(tmp_path), "torchrun.err"), "w") as f:
        f.write(err)
    assert proc.returncode == 0, err[-3000:]
    assert "resumed from" in err, err[-3000:]
    assert sorted(losses(killed)) == [1, 2, 3, 4, 5, 6]
    close(losses(killed), losses(whole), [1, 2, 3, 4, 5, 6])
