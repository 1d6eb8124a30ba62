"""Non-finite is not success: megatrain-train refuses hyper-parameters past any real run's and a model with a
non-finite weight (one line, status 2, nothing written); a run whose updates are all skipped for a non-finite
gradient stops with status 3 and one line, its summary counting the skipped steps; megatrain-export refuses
non-finite weights unless --allow-nonfinite."""
from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from megatrain.runtime import Engine, ModelConfig
from megatrain.tools import divergence, export, train

CONFIG = ModelConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
FAST = ["--seq-len", "32", "--batch", "2", "--progress", "none", "--no-plot", "--compute-dtype", "fp32"]


def _model(path, value: float) -> str:
    """A Hugging Face directory of CONFIG (fp32 files) whose lm_head holds ``value`` (at [7, 1] for a non-finite
    one, everywhere for a finite one)."""
    with Engine(CONFIG, compute_dtype=torch.float32, device="cpu") as engine:
        state = engine.state_dict()
        if value != value or abs(value) == float("inf"):
            state["lm_head.weight"][7, 1] = value
        else:
            state["lm_head.weight"] = torch.full_like(state["lm_head.weight"], value)
        engine.load_state_dict(state)
        engine.save_pretrained(path, dtype=torch.float32, allow_nonfinite=True)
    return str(path)


def _digest(root) -> dict[str, str]:
    out = {}
    for base, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(base, name), "rb") as f:
                out[os.path.join(base, name)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _one_error_line(err: str, fragment: str) -> None:
    assert err.count("\n") == 1 and err.startswith("megatrain-train: error: ") and fragment in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, fragment", [
    (["--lr", "1e308"], "lr=1e+308 must be a positive number <= 1"),
    (["--weight-decay", "1e308"], "weight_decay=1e+308 must be in [0, 10]"),
    (["--lr", "0.5", "--weight-decay", "4"], "lr=0.5 x weight_decay=4.0 = 2 must be < 1"),
    (["--max-grad-norm", "inf"], "max_grad_norm=inf must be a finite number"),
])
def test_hyper_parameters_past_any_real_run_are_refused(tmp_path, capsys, argv, fragment):
    out = tmp_path / "run"
    assert train.main(argv + ["--out", str(out)] + FAST) == 2
    _one_error_line(capsys.readouterr().err, fragment)
    assert os.listdir(tmp_path) == []


def test_a_huge_learning_rate_in_a_toml_file_is_refused(tmp_path, capsys):
    (tmp_path / "run.toml").write_text("lr = 1e308\n")
    assert train.main(["--config", str(tmp_path / "run.toml"), "--out", str(tmp_path / "run")] + FAST) == 2
    _one_error_line(capsys.readouterr().err, "lr=1e+308 must be a positive number <= 1")
    assert os.listdir(tmp_path) == ["run.toml"]


def test_a_model_with_a_nan_weight_is_refused_naming_the_tensor(tmp_path, capsys):
    model = _model(tmp_path / "model", float("nan"))
    before = _digest(tmp_path)
    assert train.main(["--model", model, "--out", str(tmp_path / "run"), "--steps", "2"] + FAST) == 2
    _one_error_line(capsys.readouterr().err, "model.safetensors: lm_head.weight holds 1 non-finite value(s)")
    assert _digest(tmp_path) == before and not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("steps, stopped_at", [(3, 3), (14, 11)])
def test_a_run_whose_every_update_is_skipped_stops_with_status_3(tmp_path, capsys, steps, stopped_at):
    """Logits of 3e38 x hidden overflow: every loss and gradient is non-finite, every update skipped. A short run
    stops at its end, a longer one once WINDOW updates in a row were skipped (seen a step later on a CPU)."""
    model = _model(tmp_path / "model", 3.0e38)
    out = tmp_path / "run"
    assert train.main(["--model", model, "--out", str(out), "--steps", str(steps)] + FAST) == divergence.EXIT_DIVERGED
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and lines[0].startswith("megatrain-train: error: training diverged: steps "), err
    assert "Traceback" not in err and "RuntimeWarning" not in err, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_code"] == 3 and summary["skipped_steps"] == stopped_at == summary["steps"]
    assert summary["skipped_step_numbers"] == list(range(1, stopped_at + 1))
    assert summary["checkpoint"] == "none" and not os.path.exists(out / "checkpoints")  # no diverged checkpoint


def test_a_run_that_trains_counts_no_skipped_steps(tmp_path):
    out = tmp_path / "run"
    assert train.main(["--out", str(out), "--steps", "2"] + FAST) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == 0 and summary["diverged"] is None and summary["exit_code"] == 0


@pytest.mark.parametrize("skipped, window, diverged", [
    ([], 10, False), ([3], 10, False), (list(range(1, 10)), 10, False), (list(range(4, 14)), 10, True),
    ([1, 2, 3, 4, 5, 7, 8, 9, 10, 11], 10, False), ([2, 3], 2, True), ([1, 3], 2, False),
])
def test_the_window_is_consecutive_skipped_updates(skipped, window, diverged):
    watch = divergence.DivergenceWatch(1, 100, window)
    assert (watch.diverged(skipped) is not None) == diverged
    assert divergence.DivergenceWatch(5, 7).window == 3  # a run of 3 steps: all 3


def test_export_refuses_non_finite_weights_unless_allowed(tmp_path, capsys):
    with Engine(CONFIG, compute_dtype=torch.float32, device="cpu") as engine:
        state = engine.state_dict()
        state["model.layers.1.mlp.up_proj.weight"][0, 0] = float("inf")
        engine.load_state_dict(state)
        engine.save_checkpoint(tmp_path / "checkpoints", blocking=True)
    before = _digest(tmp_path)
    assert export.main([str(tmp_path / "checkpoints"), str(tmp_path / "exported")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatrain-export: error: ") and "Traceback" not in err, err
    assert "model.layers.1.mlp.up_proj.weight holds 1 non-finite value(s)" in err and "--allow-nonfinite" in err
    assert _digest(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["checkpoints"]  # no staging left
    assert export.main([str(tmp_path / "checkpoints"), str(tmp_path / "exported"), "--allow-nonfinite",
                        "--dtype", "fp32"]) == 0
    from safetensors.torch import load_file

    written = load_file(str(tmp_path / "exported" / "model.safetensors"))["model.layers.1.mlp.up_proj.weight"]
    assert float(written[0, 0]) == float("inf") and int(torch.isfinite(written).logical_not().sum()) == 1
