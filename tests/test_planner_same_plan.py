"""megatrain-train runs the plan megatrain-plan plan prints for the same inputs: the plan summary.json records
equals ``megatrain-plan plan --json``'s, with the planner deciding the spill and with a spill forced."""
from __future__ import annotations

import json

import pytest

from megatrain.planner.commands import cli
from megatrain.planner.profiling import profiler
from megatrain.tools import train

TINY = dict(model_type="llama", vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.mark.parametrize("spill", [[], ["--spill", "optimizer"], ["--spill", "all"]],
                         ids=["auto", "optimizer", "all"])
def test_train_runs_the_plan_megatrain_plan_prints(spill, tmp_path, monkeypatch, capsys) -> None:
    hardware = tmp_path / "hardware.json"     # this machine, with the disk's figures: spill plans are timed
    profiler.detect().replace(disk_read_gbps=2.0, disk_write_gbps=1.5).save(str(hardware))
    monkeypatch.setenv("MEGATRAIN_HARDWARE", str(hardware))
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    nvme, out = tmp_path / "nvme", tmp_path / "run"
    common = ["--model", str(config), "--seq-len", "32", "--batch", "4", "--spill-dir", str(nvme), *spill]
    assert cli.main(["plan", *common, "--dtype", "fp32", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert train.main([*common, "--out", str(out), "--steps", "1", "--compute-dtype", "fp32", "--progress", "none",
                       "--no-plot"]) == 0
    ran = json.loads((out / "summary.json").read_text())["plan"]
    assert ran == planned["plan"]
    assert ran["spill"] == (spill[1] if spill else planned["spill"])
