"""benchmarks/plan_validation.py's GPU configs: the real shapes they name, planned by the planner for the H200
machine's recorded profile (--plan-only: nothing runs), and never run on a CPU."""
from __future__ import annotations

import importlib.util
import os
import sys

from megatrain.planner.shapes import model_shapes

ROOT = os.path.join(os.path.dirname(__file__), "..")
H200 = os.path.join(ROOT, "benchmarks", "results", "2026-11-28_H200_hardware.json")


def load_bench():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("plan_validation", os.path.join(ROOT, "benchmarks",
                                                                                  "plan_validation.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_gpu_configs_are_the_shapes_they_name():
    bench = load_bench()
    shape = lambda cfg: model_shapes.from_config(cfg).params  # noqa: E731
    preset = lambda name, **kw: shape(dict(model_shapes.PRESETS[name].config, **kw))  # noqa: E731
    g = bench.GPU_CONFIGS
    assert shape(g["1B-8192"][0]) == preset("shape:Llama-3.2-1B")
    assert shape(g["3B"][0]) == preset("shape:Llama-3.2-3B")
    assert shape(g["8B"][0]) == preset("shape:Llama-3.1-8B")
    assert shape(g["8B-24L"][0]) == preset("shape:Llama-3.1-8B", num_hidden_layers=24)
    assert shape(g["moe-gpu"][0]) == preset("shape:Qwen3-30B-A3B", num_hidden_layers=6)
    assert {name: (seq, batch, dtype) for name, (_, seq, batch, dtype) in g.items()} == {
        "1B-fp32": (2048, 8, "fp32"), "1B-8192": (8192, 4, "bf16"), "3B": (2048, 16, "bf16"),
        "8B": (4096, 16, "bf16"), "8B-24L": (4096, 16, "bf16"), "moe-gpu": (2048, 8, "bf16")}


def test_the_planner_plans_the_gpu_configs_for_the_h200_machine(monkeypatch, capsys):
    bench = load_bench()
    monkeypatch.setenv("MEGATRAIN_HARDWARE", H200)
    names = ["1B-8192", "3B", "8B", "8B-24L", "moe-gpu"]
    assert bench.main(["--plan-only", "--only", ",".join(names)]) == 0
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| config")}
    assert set(rows) == set(names)
    for name in ("1B-8192", "3B", "8B-24L", "moe-gpu"):  # planned, in bf16, with a step and memory
        row = rows[name]
        assert row[2] == "bfloat16" and float(row[5]) > 0 and float(row[7]) > 0, row
    # Llama-3.1-8B's whole shape: planned, or refused by a budget the planner names
    assert rows["8B"][2] == "bfloat16" or "infeasible" in rows["8B"][1]


def test_gpu_configs_never_run_on_a_cpu(monkeypatch, capsys):
    """With a GPU's profile but no CUDA device, only --plan-only sees the GPU configs; a run of them is refused
    in one line before anything runs."""
    bench = load_bench()
    monkeypatch.setenv("MEGATRAIN_HARDWARE", H200)
    monkeypatch.setattr(bench, "cuda_present", lambda: False)
    assert bench.main(["--only", "3B"]) == 2
    assert "--only 3B: not a config here" in capsys.readouterr().err
