"""megatrain-train as a person runs it on a cluster: one process, or torchrun starting the ranks (CPU, gloo).

``train(out, *args)`` runs the command in one process, ``torchrun(nproc, out, *args)`` under
``torchrun --standalone --nproc-per-node nproc`` (one thread per rank: the CPU is shared); both return the
finished process. ``here(capsys, *args)`` runs the one-process command's ``main`` in the test's own process (no
interpreter to start, torch imported once), for a run whose process is not what the test is about; its status
and stderr. ``losses(out)`` is the run's metrics, step -> loss.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from megatrain.tools import metrics
from megatrain.tools.train import main as train_main

TINY = ["--seq-len", "32", "--progress", "none", "--no-plot", "--warmup-steps", "1"]
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
TRAIN = os.path.join(os.path.dirname(sys.executable), "megatrain-train")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def command(*args: str, launcher: list[str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*(launcher or []), TRAIN, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def train(*args: str) -> subprocess.CompletedProcess:
    return command(*TINY, *args)


def torchrun(nproc: int, *args: str, extra: list[str] | None = None) -> subprocess.CompletedProcess:
    assert TORCHRUN is not None
    return command(*TINY, *args, launcher=[TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), *(extra or [])])


def here(capsys, *args: str) -> tuple[int, str]:
    """``train(*args)`` in this process: its status and what it wrote to stderr."""
    capsys.readouterr()
    status = train_main([*TINY, *args])
    return status, capsys.readouterr().err


def ok_here(capsys, *args: str) -> str:
    """``here``, which must succeed: its stderr."""
    status, err = here(capsys, *args)
    assert status == 0, err[-3000:]
    return err


def ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def losses(out: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics.read_metrics(os.path.join(out, "metrics.jsonl"))}


def close(a: dict[int, float], b: dict[int, float], steps: list[int], rel: float = 1e-5) -> None:
    """The losses of ``steps`` equal within float32 noise of the reduction order."""
    for step in steps:
        assert abs(a[step] - b[step]) <= rel * abs(b[step]), (step, a[step], b[step])
