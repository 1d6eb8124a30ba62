"""Ranks that would diverge stop before training: a rank with another data order, plan or options ends every rank
with one line naming what differs; a collective that waits longer than the collective timeout (the plan's, or
--collective-timeout) ends every rank with one line naming the timeout."""
from __future__ import annotations

import contextlib
import io
import os
import time

import pytest

from megatrain.planner.costs import data_parallel
from megatrain.plan.plan import Plan
from megatrain.runtime.distributed.process_group import DEFAULT_TIMEOUT_S
from megatrain.tools import ranks, train
from rank_processes import run_ranks

FAST = ["--seq-len", "32", "--batch", "4", "--progress", "none", "--no-plot", "--warmup-steps", "1", "--steps", "2"]


def _main(rank: int, world: int, argv: list[str], rank1: list[str]) -> tuple[int, str]:
    if rank == 1:
        argv = argv + rank1  # rank 1 alone runs another command
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = train.main(argv)
    return status, err.getvalue()


@pytest.mark.parametrize("what", ["data order", "plan", "options"])
def test_a_rank_that_differs_stops_every_rank(what: str, tmp_path):
    out = str(tmp_path / "run")
    plan = tmp_path / "plan.json"
    Plan(micro_batch_size=1, num_slots=3, prefetch_depth=2).save(str(plan))
    rank1 = {"data order": ["--no-shuffle"],  # rank 1 alone reads the documents in corpus order
             "plan": ["--plan", str(plan)], "options": ["--lr", "0.001"]}[what]
    for status, err in run_ranks(_main, 2, tmp_path, ["--out", out, *FAST], rank1):
        assert status == 2, err
        assert err.count("\n") == 1 and f"rank 1's {what} differ" in err, err
    assert not os.path.exists(out)  # nothing written


def test_a_per_node_out_is_refused_on_every_rank_in_one_line(tmp_path):
    """A node whose --out is not rank 0's directory (here: another path; on a cluster, the same path on each node's
    local disk) would write its checkpoint shards where rank 0 never commits them: every rank stops."""
    out, other = str(tmp_path / "run"), str(tmp_path / "node1-run")
    for status, err in run_ranks(_main, 2, tmp_path, ["--out", out, *FAST], ["--out", other]):
        assert status == 2, err
        assert err.count("\n") == 1 and "out: rank 1 does not see the run directory" in err, err
        assert "per-node output directories are not supported" in err, err
    assert not os.path.exists(out) and not os.path.exists(other)  # rank 0's directory, made and left empty, is gone


def _hung(rank: int, world: int, argv: list[str]) -> tuple[int, str, float]:
    from megatrain.runtime.engine import Engine

    if rank == 1:  # rank 1 stops answering before its first step's collectives
        step = Engine.step
        Engine.step = lambda self, *a, **k: (time.sleep(5), step(self, *a, **k))[1]  # type: ignore[method-assign]
    err = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stderr(err):
        status = train.main(argv)
    return status, err.getvalue(), time.monotonic() - start


def test_a_hung_collective_is_ended_by_the_collective_timeout(tmp_path):
    out = str(tmp_path / "run")
    (status, err, _), (status1, err1, _) = run_ranks(_hung, 2, tmp_path, ["--out", out, *FAST,
                                                                       "--collective-timeout", "2"])
    for code, text in ((status, err), (status1, err1)):  # rank 0 prints its banner first
        errors = [line for line in text.splitlines() if line.startswith("megatrain-train: error:")]
        assert code == 1 and len(errors) == 1 and text.endswith(errors[0] + "\n"), text
    assert "error: a collective waited 2 s for another rank, which stopped answering" in err, err
    assert "megatrain-train stops every rank" in err1, err1


def _timeout_after(rank: int, world: int, argv: list[str]) -> tuple[int, float, str]:
    import torch
    import torch.distributed as dist

    seen: list[float] = []
    set_timeout = ranks.Ranks.set_timeout

    def setting(self: ranks.Ranks, seconds: float) -> None:  # the group's own timeout, read once training set it
        set_timeout(self, seconds)
        seen.append(dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    ranks.Ranks.set_timeout = setting  # type: ignore[method-assign]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = train.main(argv)
    return status, seen[0], err.getvalue()


def test_without_collective_timeout_the_plans_bound_applies(tmp_path):
    """The group was made with 60 s (rank_processes); training sets the plan's bound on every rank: the floor, for the
    demo's steps of milliseconds (planner/costs/data_parallel.py, [Note: collective timeout])."""
    out = str(tmp_path / "run")
    for status, timeout, err in run_ranks(_timeout_after, 2, tmp_path, ["--out", out, *FAST, "--steps", "1"]):
        assert status == 0, err
        assert timeout == data_parallel.COLLECTIVE_TIMEOUT_FLOOR_S != DEFAULT_TIMEOUT_S, err


def test_the_collective_timeout_is_read_before_the_ranks_join(tmp_path):
    assert ranks.collective_timeout(["--collective-timeout", "7.5"]) == 7.5
    assert ranks.collective_timeout([]) == DEFAULT_TIMEOUT_S
    assert ranks.collective_timeout(["--collective-timeout", "oops"]) == DEFAULT_TIMEOUT_S  # reported later
    toml = tmp_path / "run.toml"
    toml.write_text("collective_timeout = 30\n")
    assert ranks.collective_timeout(["--config", str(toml)]) == 30.0
