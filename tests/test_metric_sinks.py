"""--log-to (tools/metric_sinks.py): TensorBoard scalars equal the records logged; a resume purges later steps."""
from __future__ import annotations

import builtins

import pytest

from megatrain.tools import metric_sinks
from megatrain.tools.train_config import TrainConfig, TrainConfigError

pytest.importorskip("tensorboard")


def read_scalars(directory) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def records(steps):
    return [{"step": s, "loss": 5.0 - 0.25 * s, "lr": 1e-3 * s, "tokens": 64 * s, "note": "x", "skipped": False}
            for s in steps]


def test_tensorboard_scalars_equal_the_records(tmp_path):
    sink = metric_sinks.open(TrainConfig(log_to="tensorboard"), str(tmp_path))
    for r in records(range(1, 5)):
        sink.log(r["step"], r)
    sink.close()
    scalars = read_scalars(tmp_path / "tensorboard")
    assert set(scalars) == {"train/loss", "train/lr", "train/tokens"}
    assert scalars["train/loss"] == [(s, pytest.approx(5.0 - 0.25 * s)) for s in range(1, 5)]
    assert scalars["train/tokens"] == [(s, 64 * s) for s in range(1, 5)]


def test_evaluation_fields_are_eval_scalars(tmp_path):
    sink = metric_sinks.open(TrainConfig(log_to="tensorboard"), str(tmp_path))
    sink.log(1, records([1])[0])
    sink.log(2, {**records([2])[0], "eval_loss": 3.5, "eval_perplexity": 33.0, "eval_tokens": 640})
    sink.close()
    scalars = read_scalars(tmp_path / "tensorboard")
    assert scalars["eval/loss"] == [(2, 3.5)] and scalars["eval/perplexity"] == [(2, 33.0)]
    assert scalars["eval/tokens"] == [(2, 640)] and "train/eval_loss" not in scalars


def test_a_resume_drops_the_events_after_its_step(tmp_path):
    sink = metric_sinks.open(TrainConfig(log_to="tensorboard"), str(tmp_path))
    for r in records(range(1, 6)):
        sink.log(r["step"], r)
    sink.close()
    resumed = metric_sinks.open(TrainConfig(log_to="tensorboard"), str(tmp_path), start_step=3)
    for r in records(range(4, 7)):
        resumed.log(r["step"], {**r, "loss": -1.0})
    resumed.close()
    loss = read_scalars(tmp_path / "tensorboard")["train/loss"]
    assert [s for s, _ in loss] == [1, 2, 3, 4, 5, 6]
    assert [v for s, v in loss if s > 3] == [-1.0, -1.0, -1.0]


def test_none_writes_nothing_and_missing_tensorboard_is_one_line(tmp_path, monkeypatch):
    sink = metric_sinks.open(TrainConfig(), str(tmp_path))
    sink.log(1, records([1])[0])
    sink.close()
    assert list(tmp_path.iterdir()) == []
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "tensorboard" or name.startswith("tensorboard."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(TrainConfigError, match="pip install tensorboard") as e:
        metric_sinks.check(TrainConfig(log_to="tensorboard"))
    assert "\n" not in str(e.value)
    with pytest.raises(TrainConfigError, match="log_to='wandb' is not one of none, tensorboard"):
        TrainConfig(log_to="wandb")


def test_megatrain_train_logs_the_metrics_rows_to_tensorboard(tmp_path):
    import json

    from megatrain.tools import train

    out = tmp_path / "run"
    assert train.main(["--out", str(out), "--steps", "3", "--seq-len", "32", "--batch", "2", "--progress", "none",
                       "--no-plot", "--log-to", "tensorboard"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scalars = read_scalars(out / "tensorboard")
    assert scalars["train/loss"] == [(r["step"], pytest.approx(r["loss"])) for r in rows]
