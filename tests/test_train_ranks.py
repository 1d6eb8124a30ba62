"""megatrain-train with several ranks (CPU, gloo): the same loss curve as one process on the same global batch,
rank 0 alone writes the run's files, an input error on any rank stops every rank with that line, status 2."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest

from megatrain.tools import metrics, train
from rank_processes import run_ranks

FAST = ["--seq-len", "32", "--batch", "4", "--progress", "none", "--no-plot", "--warmup-steps", "1"]


def _main(rank: int, world: int, argv: list[str], bad_on: int | None) -> tuple[int, str]:
    """train.main on one rank, its stderr captured; ``bad_on``: the rank given a data file that does not exist."""
    if rank == bad_on:
        argv = argv + ["--data", os.path.join(os.path.dirname(argv[1]), "missing.txt")]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = train.main(argv)
    return status, err.getvalue()


def test_two_ranks_train_the_same_curve_as_one_process(tmp_path):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    # Every rank evaluates the whole eval set, in step with the others: a few documents of a small corpus (one
    # document of the demo's is hundreds of eval rows).
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i}: " + "lorem ipsum dolor sit amet " * (2 + i % 5)})
                            + "\n" for i in range(40)))
    held_out = ["--data", str(data), "--eval-fraction", "0.1"]
    assert train.main(["--out", one, *FAST, *held_out, "--steps", "3"]) == 0
    (status0, err0), (status1, err1) = run_ranks(_main, 2, tmp_path, ["--out", two, *FAST, *held_out, "--steps", "3"],
                                                 None)
    assert (status0, status1) == (0, 0), (err0, err1)
    assert err1 == "", err1  # the other rank says nothing: rank 0 reports
    assert "trained steps 1-3" in err0
    single = metrics.read_metrics(os.path.join(one, "metrics.jsonl"))
    ranks = metrics.read_metrics(os.path.join(two, "metrics.jsonl"))
    assert [r["step"] for r in ranks] == [1, 2, 3]  # one row per step: rank 0's
    for a, b in zip(ranks, single):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["loss"], b["loss"])
        assert a["step_tokens"] == b["step_tokens"]
    assert ranks[-1]["eval_tokens"] == single[-1]["eval_tokens"]
    assert abs(ranks[-1]["eval_loss"] - single[-1]["eval_loss"]) <= 1e-5 * single[-1]["eval_loss"]
    assert os.path.isfile(os.path.join(two, "summary.json"))
    assert sorted(os.listdir(os.path.join(two, "checkpoints"))) == ["latest", "step-00000003"]


def test_an_input_error_on_one_rank_stops_every_rank(tmp_path):
    out = str(tmp_path / "run")
    results = run_ranks(_main, 2, tmp_path, ["--out", out, *FAST, "--steps", "2"], 1)
    for status, err in results:
        assert status == 2, err
        assert err.count("\n") == 1 and err.startswith("megatrain-train: error: ") and "missing.txt" in err, err
    assert results[0][1].startswith("megatrain-train: error: rank 1: ")
    assert not os.path.exists(out)  # nothing written


def test_a_batch_that_does_not_divide_among_the_ranks_is_refused(tmp_path):
    out = str(tmp_path / "run")
    argv = ["--out", out, *FAST[:2], "--batch", "3", *FAST[4:], "--steps", "2"]
    for status, err in run_ranks(_main, 2, tmp_path, argv, None):
        assert status == 2 and "does not divide among 2 ranks" in err, err
    assert not os.path.exists(out)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_torchrun_command(tmp_path):
    """The README's command: torchrun starts the ranks, the engine joins the group from its environment."""
    out = str(tmp_path / "run")
    cmd = [shutil.which("torchrun"), "--standalone", "--nproc-per-node", "2",
           os.path.join(os.path.dirname(sys.executable), "megatrain-train"), "--out", out, *FAST, "--steps", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert [r["step"] for r in metrics.read_metrics(os.path.join(out, "metrics.jsonl"))] == [1, 2]


def _fail_on_rank_1(rank: int, world: int, argv: list[str]) -> tuple[int, str]:
    """train.main where rank 1's second step fails (a bad input only it sees)."""
    from megatrain.runtime import Engine, InputError

    if rank == 1:
        step, calls = Engine.step, []

        def failing(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise InputError("labels hold an id outside the vocabulary (a test's bad batch on rank 1)")
            return step(self, *args, **kwargs)
        Engine.step = failing
    return _main(rank, world, argv, None)


def test_a_failure_during_training_stops_every_rank(tmp_path):
    out = str(tmp_path / "run")
    (status0, err0), (status1, err1) = run_ranks(_fail_on_rank_1, 2, tmp_path, ["--out", out, *FAST, "--steps", "4"],
                                                 collective_timeout_s=15.0)  # a closed connection or the timeout
    assert status1 == 2 and err1.count("\n") == 1 and "a test's bad batch on rank 1" in err1, err1
    assert status0 == 1, err0
    last = err0.strip().splitlines()[-1]
    assert last.startswith("megatrain-train: error: another rank of this run stopped"), err0
    assert "Traceback" not in err0
