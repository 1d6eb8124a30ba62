"""--log-to (tools/metric_sinks.py): TensorBoard scalars equal the records logged; a resume purges later steps;
Weights & Biases (offline) gets the run's options, the same scalars and the summary; several targets at once."""
from __future__ import annotations

import builtins
import glob
import json
import struct

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
    for bad in ("mlflow", "wandb,wandb", "none,wandb", "tensorboard,"):
        with pytest.raises(TrainConfigError, match="is not one of none, tensorboard, wandb .*tensorboard,wandb"):
            TrainConfig(log_to=bad)
    assert TrainConfig(log_to="tensorboard, wandb").log_to == "tensorboard, wandb"


def test_megatrain_train_logs_the_metrics_rows_to_tensorboard(tmp_path):
    import json

    from megatrain.tools import train

    out = tmp_path / "run"
    assert train.main(["--out", str(out), "--steps", "3", "--seq-len", "32", "--batch", "2", "--progress", "none",
                       "--no-plot", "--log-to", "tensorboard"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scalars = read_scalars(out / "tensorboard")
    assert scalars["train/loss"] == [(r["step"], pytest.approx(r["loss"])) for r in rows]


def wandb_records(wandb_dir) -> dict[str, list]:
    """An offline wandb run's records (``WANDB_DIR/wandb/offline-run-*/run-*.wandb``: wandb's LevelDB-style log of
    protobuf records, in 32 KiB blocks after a 7-byte header) by kind: run (with its config), history, summary."""
    import wandb
    from wandb.proto import wandb_internal_pb2 as pb

    wandb.teardown()  # the wandb service writes the file: stopped, it has written everything
    (path,) = glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, pending, out = 7, b"", {}
    while pos < len(data):
        left = 32768 - pos % 32768
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7]) if left >= 7 else (0, 0)
        if length == 0 and kind == 0:  # the rest of a block is padding
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            out.setdefault(record.WhichOneof("record_type"), []).append(getattr(record, record.WhichOneof(
                "record_type")))
    return out


def test_megatrain_train_logs_to_wandb_offline_and_tensorboard_at_once(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from megatrain.tools import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    out = tmp_path / "run"
    assert train.main(["--out", str(out), "--steps", "3", "--seq-len", "32", "--batch", "2", "--progress", "none",
                       "--no-plot", "--lr", "3e-3", "--log-to", "tensorboard,wandb"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert read_scalars(out / "tensorboard")["train/loss"] == [(r["step"], pytest.approx(r["loss"])) for r in rows]
    records = wandb_records(tmp_path)
    (run,) = records["run"]
    assert run.project == "megatrain" and run.display_name == "run"
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["lr"] == 3e-3 and config["steps"] == 3 and config["log_to"] == "tensorboard,wandb"
    history = {int(h.step.num): {i.nested_key[0]: json.loads(i.value_json) for i in h.item} for h in records["history"]}
    assert sorted(history) == [r["step"] for r in rows]
    for r in rows:
        assert history[r["step"]]["train/loss"] == pytest.approx(r["loss"])
        assert history[r["step"]]["train/tokens"] == r["tokens"]
    logged = {u.key: json.loads(u.value_json) for s in records["summary"] for u in s.update if u.key}
    assert logged["num_parameters"] == summary["num_parameters"] and logged["exit_code"] == 0
    assert logged["plan"] == summary["plan"]


def test_a_resumed_run_continues_its_wandb_run_and_a_missing_wandb_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "first"))
    metric_sinks.open(TrainConfig(log_to="wandb"), str(tmp_path / "out")).close({"exit_code": 0})
    run_id = (tmp_path / "out" / "wandb" / "run_id").read_text()
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "again"))
    metric_sinks.open(TrainConfig(log_to="wandb"), str(tmp_path / "out"), start_step=2).close({"exit_code": 0})
    (again,) = wandb_records(tmp_path / "again")["run"]
    assert again.run_id == run_id == wandb_records(tmp_path / "first")["run"][0].run_id
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb" or name.startswith("wandb."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(TrainConfigError, match="pip install wandb") as e:
        metric_sinks.check(TrainConfig(log_to="tensorboard,wandb"))
    assert "\n" not in str(e.value)


def test_per_expert_and_per_layer_lists_and_the_breakdown_are_scalars_too(tmp_path):
    # Every number of a metrics row reaches TensorBoard: a mixture of experts' lists entry by entry, the step's
    # time breakdown key by key; strings, booleans and None stay out.
    row = {"step": 1, "loss": 2.0, "expert_tokens": [5, 0, 7, 4], "expert_load": [1.25, 1.5],
           "breakdown": {"step_s": 0.5, "compute_s": 0.25}, "grad_norm": None, "note": "x", "skipped": True}
    sink = metric_sinks.open(TrainConfig(log_to="tensorboard"), str(tmp_path))
    sink.log(1, row)
    sink.close()
    scalars = read_scalars(tmp_path / "tensorboard")
    assert {tag: values[0][1] for tag, values in scalars.items()} == {
        "train/loss": 2.0, "train/expert_tokens/expert_0": 5, "train/expert_tokens/expert_1": 0,
        "train/expert_tokens/expert_2": 7, "train/expert_tokens/expert_3": 4, "train/expert_load/layer_0": 1.25,
        "train/expert_load/layer_1": 1.5, "train/breakdown/step_s": 0.5, "train/breakdown/compute_s": 0.25}


def test_wandb_files_land_in_out_wandb_and_the_summary_goes_to_stdout(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    from megatrain.tools import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    out = tmp_path / "run"
    assert train.main(["--out", str(out), "--steps", "2", "--seq-len", "32", "--batch", "2", "--progress", "none",
                       "--no-plot", "--log-to", "tensorboard,wandb"]) == 0
    wandb_records(out)  # OUT/wandb/offline-run-*/: wandb's own files directly under OUT/wandb
    assert not (out / "wandb" / "wandb").exists() and (out / "wandb" / "run_id").is_file()
    captured = capsys.readouterr()
    # The summary on stdout (what `> log.txt` keeps), its outputs block naming every file and folder written.
    assert "trained steps 1-2" in captured.out
    block = captured.out[captured.out.index("outputs"):]
    for name in ("metrics.jsonl", "summary.json", "run.json", "checkpoints", "tensorboard/", "wandb/"):
        assert f"{out}/{name}" in block, name
    written = {p.name for p in out.iterdir()} - {"megatrain.lock"}
    assert all(name in block for name in written), (written, block)
