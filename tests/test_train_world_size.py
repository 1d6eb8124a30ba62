"""megatrain-train --resume at another world size, from the command line: the plan is made again for the new
per-rank batch (said in one line) and the resumed steps' losses are those of an uninterrupted run at the new world
size, within float32 noise of the reduction order (W=2 -> 1, 1 -> 2, 2 -> 3)."""
from __future__ import annotations

import os

import pytest

from cli_ranks import TORCHRUN, close, losses, ok, ok_here, torchrun
from megatrain.plan.plan import default_plan
from megatrain.tools import world_change

pytestmark = pytest.mark.skipif(TORCHRUN is None, reason="torchrun not on PATH")
RUN = ["--batch", "6", "--steps", "4", "--save-every", "2"]
STEP_2 = os.path.join("checkpoints", "step-00000002")


def test_the_world_size_a_checkpoint_was_written_at():
    plan = default_plan(clipping=True)
    assert world_change.replan({"world_size": 2}, plan, 6, 2) is None
    line = world_change.replan({"world_size": 2}, plan, 6, 3)
    assert line is not None and line.startswith("world size 2 -> 3: planned again for 2 sequences per rank")
    assert world_change.replan({}, plan, 6, 3) is None  # neither the extra nor a fingerprint says: keep the plan


def test_resume_two_ranks_in_one_process_and_back(tmp_path, capsys):
    one, two, r21, r12 = (str(tmp_path / n) for n in ("one", "two", "r21", "r12"))
    ok_here(capsys, "--out", one, *RUN)  # the one-process runs in this process (cli_ranks.here)
    ok(torchrun(2, "--out", two, *RUN))
    err = ok_here(capsys, "--resume", os.path.join(two, STEP_2), "--out", r21)
    assert "megatrain-train: resume: world size 2 -> 1: planned again for 6 sequences per rank" in err, err
    close(losses(r21), losses(one), [3, 4])
    assert sorted(losses(r21)) == [3, 4]
    err = ok(torchrun(2, "--resume", os.path.join(one, STEP_2), "--out", r12))
    assert "world size 1 -> 2: planned again for 3 sequences per rank" in err, err
    close(losses(r12), losses(two), [3, 4])


@pytest.mark.slow
def test_resume_two_ranks_at_three(tmp_path):
    two, three, r23 = (str(tmp_path / n) for n in ("two", "three", "r23"))
    ok(torchrun(2, "--out", two, *RUN))
    ok(torchrun(3, "--out", three, *RUN))
    err = ok(torchrun(3, "--resume", os.path.join(two, STEP_2), "--out", r23))
    assert "world size 2 -> 3: planned again for 2 sequences per rank" in err, err
    close(losses(r23), losses(three), [3, 4])
