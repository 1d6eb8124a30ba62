"""benchmarks/throughput.py, as a user runs it: megatrain with the planner's plan (or a hand-made one) against
PyTorch from the same weights and batches, the losses of every step side by side.

The whole command runs once (the planner's plan); the hand-made plan's megatrain run is the command's own child
(``--child megatrain``, what the command starts for each system) on the same arguments, held to the PyTorch losses
of that run: the PyTorch side does not depend on ``--plan``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "throughput.py")
ARGS = ["--model", "tiny", "--seq", "32", "--batch", "4", "--micro-batch", "2", "--steps", "2", "--cpu"]


@pytest.fixture(scope="module")
def planner_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("throughput")
    r = subprocess.run([sys.executable, SCRIPT, *ARGS, "--plan", "planner", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (result,) = out.glob("*_throughput_tiny.json")
    return result


def _agree(pytorch: dict, megatrain: dict) -> None:
    assert pytorch["status"] == megatrain["status"] == "ok"
    assert len(pytorch["losses"]) == len(megatrain["losses"]) == 2
    # fp32 on a CPU: the same training up to summation order (micro-batches of 4 against PyTorch's 2 in one case)
    assert max(abs(a - b) for a, b in zip(pytorch["losses"], megatrain["losses"])) < 1e-4


def test_throughput_compares_every_steps_loss_with_the_planners_plan(planner_run) -> None:
    pytorch, megatrain = json.loads(planner_run.read_text())["results"]
    _agree(pytorch, megatrain)
    p = megatrain["plan"]  # the planner keeps every layer of a model this small, the whole batch in one micro-batch
    assert p["micro_batch_size"] == 4 and len(p["kept_layers"]) == 4
    md = planner_run.with_suffix(".md").read_text()
    assert "megatrain's plan (planner)" in md
    # the tiny model fits without activation checkpointing: PyTorch runs without it
    assert pytorch["activation_checkpointing"].startswith("off (estimate") and "checkpointing: off" in md


def test_a_hand_made_plan_trains_pytorchs_losses(planner_run) -> None:
    r = subprocess.run([sys.executable, SCRIPT, "--child", "megatrain", *ARGS, "--plan", "manual"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    megatrain = json.loads(r.stdout.strip().splitlines()[-1])
    pytorch = json.loads(planner_run.read_text())["results"][0]
    _agree(pytorch, megatrain)
    assert megatrain["plan"]["micro_batch_size"] == 2 and megatrain["plan"]["kept_layers"] == []
