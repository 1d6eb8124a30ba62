"""benchmarks/device_memory.py on a recorded run made up here: its planner figures are the memory model's own, by
term, and the largest-phase alternative is the common terms plus one phase."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from megatrain.planner.profiling import hardware
from megatrain.planner.costs import memory_model
from megatrain.planner.shapes import model_shapes
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from peer_runners.spec import model_config  # noqa: E402


def test_a_recorded_run_is_priced_term_by_term(tmp_path):
    plan = Plan(micro_batch_size=2, kept_layers=(1,), loss_chunk_tokens=64)
    run = {"model": "tiny", "layers": 2, "seq": 128, "batch": 4, "variant": "planner", "clipping": True,
           "plan": plan.to_dict(), "peak_gpu_bytes": 3 * 2**30, "peak_gpu_reserved_bytes": 4 * 2**30}
    (tmp_path / "2026-01-01_H200_step_anatomy_tiny.json").write_text(json.dumps({"runs": [run]}))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device_memory.py"), "--results", str(tmp_path),
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    [path] = (tmp_path / "out").glob("*_H200_device_memory.json")
    [row] = json.loads(path.read_text())["runs"]

    shape = model_shapes.from_config(model_config("tiny", 2, 128))
    est = memory_model.estimate(shape, Workload(seq_len=128, batch=4), plan, hardware.preset("H200"))
    device = {c.name: c.nbytes for c in est.components if c.where == "device"}
    tensors = est.device_bytes - device["allocator slack"] - device["CUDA context"]
    assert row["planner_bytes"] == est.device_bytes and row["tensors_bytes"] == tensors
    common = tensors - sum(device[k] for k in ("kept activations", "layer working set", "attention working set",
                                                "logits chunk"))
    loss = device["kept activations"] + device["logits chunk"]
    assert row["phases_bytes"] >= common + loss and row["phases_bytes"] < tensors
    assert row["largest_phase"] in ("loss", "kept layer's backward", "recomputed layer's backward")
    assert "| 2026-01-01 planner | tiny | 128 x 4 | 3.00 | 4.00 |" in r.stdout


def test_no_recorded_run_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device_memory.py"), "--results", str(tmp_path),
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "no recorded H200 run" in r.stderr
