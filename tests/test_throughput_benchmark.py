"""benchmarks/throughput.py, as a user runs it: megatrain with the planner's plan (or a hand-made one) against
PyTorch from the same weights and batches, the losses of every step side by side."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "throughput.py")


@pytest.mark.parametrize("plan", ["planner", "manual"])
def test_throughput_compares_every_steps_loss(tmp_path, plan: str) -> None:
    r = subprocess.run([sys.executable, SCRIPT, "--model", "tiny", "--seq", "32", "--batch", "4", "--micro-batch", "2",
                        "--steps", "2", "--cpu", "--plan", plan, "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (result,) = tmp_path.glob("*_throughput_tiny.json")
    pytorch, megatrain = json.loads(result.read_text())["results"]
    assert pytorch["status"] == megatrain["status"] == "ok"
    assert len(pytorch["losses"]) == len(megatrain["losses"]) == 2
    # fp32 on a CPU: the same training up to summation order (micro-batches of 4 against PyTorch's 2 in one case)
    assert max(abs(a - b) for a, b in zip(pytorch["losses"], megatrain["losses"])) < 1e-4
    p = megatrain["plan"]
    if plan == "manual":
        assert p["micro_batch_size"] == 2 and p["kept_layers"] == []
    else:  # the planner keeps every layer of a model this small, the whole batch in one micro-batch
        assert p["micro_batch_size"] == 4 and len(p["kept_layers"]) == 4
    md = result.with_suffix(".md").read_text()
    assert f"megatrain's plan ({plan})" in md
    # the tiny model fits without activation checkpointing: PyTorch runs without it
    assert pytorch["activation_checkpointing"].startswith("off (estimate") and "checkpointing: off" in md
