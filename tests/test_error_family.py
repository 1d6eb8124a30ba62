"""One exception family: every user-fixable error is a MegatrainError with a one-line message.

Includes the disk-full paths (checkpoint, export, spill): one line naming the file and the space needed, no
temporary file left behind, the previous files untouched.
"""
from __future__ import annotations

import ast
import errno
import importlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

import megatrain.errors
from megatrain.planner.profiling.hardware import HardwareError
from megatrain.plan.plan import PlanError
from megatrain.planner.shapes.workload import WorkloadError
from megatrain.runtime import (CheckpointError, ClosedError, ConfigError, Engine, InputError, MegatrainError,
                               ModelConfig, OptimizerConfig, Plan)
from megatrain.runtime.io import hf_io
from megatrain.runtime.spill.spill_io import SpillError

CONFIG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2)


def _one_line(err) -> str:
    msg = str(err.value)
    assert isinstance(err.value, MegatrainError) and "\n" not in msg, repr(err.value)
    return msg


def test_every_error_type_is_a_megatrain_error() -> None:
    assert MegatrainError is megatrain.errors.MegatrainError  # re-exported unchanged
    for cls in (PlanError, WorkloadError, HardwareError, ConfigError, InputError, CheckpointError, ClosedError,
                SpillError):
        assert issubclass(cls, MegatrainError), cls
    assert issubclass(MegatrainError, ValueError)  # code that caught ValueError keeps working


def test_every_error_class_in_the_product_is_a_megatrain_error() -> None:
    """Every ``class ...Error`` in megatrain/, models/, plan/, planner/, runtime/ and tools/ (found in the source, so
    a new one is checked without being listed here) belongs to the one family a CLI prints as one line."""
    root = pathlib.Path(__file__).resolve().parent.parent
    packages = {"megatrain": "megatrain", "models": "megatrain.models", "plan": "megatrain.plan",
                "planner": "megatrain.planner", "runtime": "megatrain.runtime", "tools": "megatrain.tools"}
    found = []
    for folder, package in packages.items():
        for path in sorted((root / folder).rglob("*.py")):
            names = [n.name for n in ast.parse(path.read_text()).body
                     if isinstance(n, ast.ClassDef) and n.name.endswith("Error")]
            if names:
                parts = path.relative_to(root / folder).with_suffix("").parts
                module = importlib.import_module(".".join((package, *parts)).removesuffix(".__init__"))
                found += [getattr(module, n) for n in names]
    assert len(found) >= 20, found
    outside = [f"{c.__module__}.{c.__name__}" for c in found if not issubclass(c, MegatrainError)]
    assert not outside, f"user errors outside megatrain.errors.MegatrainError: {outside}"


def test_the_planner_still_imports_no_runtime() -> None:
    code = ("import sys, megatrain.plan.plan, megatrain.planner.shapes.workload, megatrain.planner.profiling.hardware; "
            "bad = [m for m in sys.modules if m.startswith('megatrain.runtime') or m == 'torch']; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_betas_none_is_one_line() -> None:
    with pytest.raises(MegatrainError) as err:
        OptimizerConfig(betas=None)
    assert "betas=None" in _one_line(err)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    with Engine(CONFIG, compute_dtype=torch.float32, device="cpu") as engine:
        ids = torch.randint(0, 32, (2, 8))
        engine.step(ids, ids)
        engine.save_checkpoint(root, blocking=True)
    return root / "step-00000001"


@pytest.fixture()
def saved(checkpoint, tmp_path):
    shutil.copytree(checkpoint, tmp_path / "step-00000001")
    return tmp_path / "step-00000001"


@pytest.mark.parametrize("field, value", [
    ("block_steps", "1"), ("block_steps", ["1", "1", "1", "1"]), ("block_steps", [1.0]), ("block_steps", [1.5] * 4),
    ("block_steps", None), ("step_count", "1"), ("step_count", -1), ("seed", "x"), ("compute_dtype", ["f32"]),
    ("optimizer", {"lr": "x"}), ("model_config", {"vocab_size": "32"}), ("plan", []),
])
def test_bad_manifest_fields_are_one_line(saved, field, value) -> None:
    path = saved / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["engine"][field] = value
    path.write_text(json.dumps(manifest))
    with pytest.raises(MegatrainError) as err:
        Engine.load_checkpoint(saved)
    _one_line(err)


def test_export_disk_full_names_the_file_and_leaves_no_tmp(tmp_path, monkeypatch) -> None:
    out = tmp_path / "hf"
    with Engine(CONFIG, compute_dtype=torch.float32, device="cpu") as engine:
        engine.save_pretrained(out)
        before = {p: (out / p).read_bytes() for p in os.listdir(out)}
        real_open = open

        class Full:
            def __init__(self, f) -> None:
                self.f = f

            def write(self, data) -> int:
                raise OSError(errno.ENOSPC, "No space left on device")

            def __enter__(self):
                return self

            def __exit__(self, *exc) -> None:
                self.f.close()

        monkeypatch.setattr(hf_io, "open", lambda p, mode="r", **kw: Full(real_open(p, mode, **kw))
                            if "w" in mode else real_open(p, mode, **kw), raising=False)
        ids = torch.randint(0, 32, (2, 8))
        engine.step(ids, ids)
        with pytest.raises(CheckpointError) as err:
            engine.save_pretrained(out)
        msg = _one_line(err)
        need = engine.num_parameters * 2  # bf16
        assert "model.safetensors" in msg and "disk is full" in msg and f"{need / 2**20:.1f} MiB" in msg, msg
    assert {p: (out / p).read_bytes() for p in os.listdir(out)} == before, "the failed export changed the old one"


def test_spill_space_error_reports_the_total(tmp_path, monkeypatch) -> None:
    plan = Plan(spill="all", spill_dir=str(tmp_path), io_backend="posix")
    with Engine(CONFIG, plan=plan, compute_dtype=torch.float32, device="cpu") as engine:
        need = engine.store.nvme_bytes
        files = len(engine.store.spilled)
    assert files > 1

    from megatrain.runtime.spill import spill_files

    class Usage:
        free = need // files  # room for one file, not for all of them

    monkeypatch.setattr(spill_files.shutil, "disk_usage", lambda path: Usage)
    with pytest.raises(SpillError) as err:
        Engine(CONFIG, plan=plan, compute_dtype=torch.float32, device="cpu")
    msg = _one_line(err)
    assert f"need {need / 2**20:.1f} MiB in all" in msg and f"{Usage.free / 2**20:.1f} MiB free" in msg, msg
    assert os.listdir(tmp_path) == []


def test_a_line_break_in_what_the_user_passed_stays_escaped(tmp_path) -> None:
    """A path (or any value) with a line break, echoed into a message, leaves the message one line: the break
    is escaped, so what was passed is still readable."""
    for load in (Engine.load_checkpoint, Engine.from_pretrained):
        with pytest.raises(MegatrainError) as err:
            load(str(tmp_path / "a\nb\rc"), device="cpu")
        assert "a\\nb\\rc" in _one_line(err)
    assert str(PlanError("x\ny")) == "x\\ny" and PlanError("x\ny").args == ("x\\ny",)
