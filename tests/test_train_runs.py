"""megatrain-train's run directories: nothing lost or mixed up, every bad input one line before anything is written.

Each test runs the real command in-process (``train.main``) on the demo model with a few short steps.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil

import numpy as np
import pytest

from megatrain.runtime import Engine
from megatrain.tools import lr_schedule, metrics, run_dir, train

FAST = ["--seq-len", "32", "--batch", "2", "--progress", "none", "--no-plot", "--warmup-steps", "1"]


def snapshot(root) -> dict[str, str]:
    """Every file under ``root`` with the hash of its bytes (and symlinks' targets)."""
    out = {}
    for base, dirs, files in os.walk(root):
        for name in files:
            full = os.path.join(base, name)
            rel = os.path.relpath(full, root)
            if os.path.islink(full):
                out[rel] = "link:" + os.readlink(full)
            else:
                with open(full, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
        for name in dirs:
            out[os.path.relpath(os.path.join(base, name), root) + "/"] = "dir"
    return out


def steps_of(out) -> list[int]:
    return [r["step"] for r in metrics.read_metrics(os.path.join(out, "metrics.jsonl"))]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatrain-train: error: ") and "Traceback" not in err, err
    return err


def train_run(out, *args) -> int:
    return train.main(["--out", str(out)] + FAST + list(args))


# ---------------------------------------------------------------------- item 1: an existing run is never replaced
def test_an_existing_run_directory_is_refused_and_left_as_it_was(tmp_path, capsys):
    out = tmp_path / "run1"
    assert train_run(out, "--steps", "3") == 0
    before = snapshot(out)
    capsys.readouterr()
    assert train_run(out, "--steps", "2") == 2
    err = one_error_line(capsys)
    assert f"--resume {out}" in err and "--overwrite" in err
    assert snapshot(out) == before


def test_the_demo_twice_refuses_the_second_time(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert train.main(FAST + ["--steps", "2"]) == 0
    before = snapshot(tmp_path)
    capsys.readouterr()
    assert train.main(FAST + ["--steps", "2"]) == 2
    assert "megatrain-run already holds an earlier run" in one_error_line(capsys)
    assert snapshot(tmp_path) == before


def test_overwrite_replaces_only_the_runs_own_files(tmp_path, capsys):
    out = tmp_path / "run1"
    assert train_run(out, "--steps", "4") == 0
    (out / "notes.txt").write_text("mine")
    (out / "data").mkdir()
    (out / "data" / "corpus.txt").write_text("also mine")
    assert train_run(out, "--steps", "2", "--overwrite") == 0
    assert steps_of(out) == [1, 2]
    assert (out / "notes.txt").read_text() == "mine" and (out / "data" / "corpus.txt").read_text() == "also mine"
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step-00000002"]
    assert "deleted the earlier run's" in capsys.readouterr().err
    # It must be asked for on the command line: a config file cannot carry it from run to run.
    (tmp_path / "run.toml").write_text("overwrite = true\n")
    assert train.main(["--config", str(tmp_path / "run.toml"), "--out", str(out)]) == 2
    assert "command-line option only" in one_error_line(capsys)


def test_a_directory_with_other_files_is_refused_without_overwrite(tmp_path, capsys):
    (tmp_path / "paper.tex").write_text("x")
    assert train_run(tmp_path, "--steps", "1") == 2
    err = one_error_line(capsys)
    assert "paper.tex" in err and "--overwrite" in err and "--resume" not in err
    assert os.listdir(tmp_path) == ["paper.tex"]


def test_nothing_is_written_before_the_inputs_are_checked(tmp_path, capsys):
    out = tmp_path / "run1"
    assert train_run(out, "--steps", "3") == 0
    before = snapshot(out)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    capsys.readouterr()
    # Even with --overwrite, bad data is found before the earlier run's files are touched.
    assert train_run(out, "--steps", "2", "--overwrite", "--data", str(empty)) == 2
    assert "no tokens to train on" in one_error_line(capsys)
    assert snapshot(out) == before
    fresh = tmp_path / "fresh" / "run"
    assert train_run(fresh, "--data", str(empty)) == 2
    one_error_line(capsys)
    assert not (tmp_path / "fresh").exists()


# ---------------------------------------------------------------------- item 2: a resumed run writes into its own run
def test_resuming_a_copy_writes_into_the_copy(tmp_path, capsys):
    run1, copy = tmp_path / "run1", tmp_path / "run1_c2"
    assert train_run(run1, "--steps", "4", "--save-every", "2") == 0
    shutil.copytree(run1, copy)
    before = snapshot(run1)
    capsys.readouterr()
    assert train.main(["--resume", str(copy / "checkpoints" / "step-00000004"), "--steps", "6"]) == 0
    assert f"outputs      {os.path.abspath(copy)}" in capsys.readouterr().err
    assert snapshot(run1) == before
    assert steps_of(copy) == [1, 2, 3, 4, 5, 6]
    engine = Engine.load_checkpoint(str(copy / "checkpoints"))
    assert engine.step_count == 6
    engine.close()


def test_resuming_an_older_checkpoint_branches_only_into_a_new_directory(tmp_path, capsys):
    run1 = tmp_path / "run1"
    assert train_run(run1, "--steps", "4", "--save-every", "2") == 0
    before = snapshot(run1)
    step2 = str(run1 / "checkpoints" / "step-00000002")
    capsys.readouterr()
    assert train.main(["--resume", step2, "--steps", "4"]) == 2
    err = one_error_line(capsys)
    assert "went on to step 4 after step 2" in err and "--out" in err
    assert snapshot(run1) == before
    branch = tmp_path / "branch"
    assert train.main(["--resume", step2, "--steps", "4", "--out", str(branch)]) == 0
    assert steps_of(branch) == [3, 4] and snapshot(run1) == before
    # Same data position, schedule and state: the branch repeats the original steps exactly (fp32 on CPU).
    original = metrics.read_metrics(str(run1 / "metrics.jsonl"))
    assert [r["loss"] for r in metrics.read_metrics(str(branch / "metrics.jsonl"))] == \
        [r["loss"] for r in original[2:]]


# ---------------------------------------------------------------------- item 3: one history after a crash
def test_resume_after_a_crash_keeps_one_history(tmp_path):
    out = tmp_path / "run"
    assert train_run(out, "--steps", "5", "--save-every", "3") == 0
    reference = metrics.read_metrics(str(out / "metrics.jsonl"))
    # As if killed after step 5 but before its checkpoint: step 3 is the latest, a torn line at the end.
    shutil.rmtree(out / "checkpoints" / "step-00000005")
    (out / "checkpoints" / "latest").write_text("step-00000003\n")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss": 1.2')
    assert train.main(["--resume", str(out), "--progress", "none"]) == 0
    resumed = metrics.read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference]
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 5


def test_read_metrics_tolerates_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo\xe2')
    assert [r["step"] for r in metrics.read_metrics(str(path))] == [1, 2]
    assert metrics.truncate_after(str(path), 1) == 2
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n'
    assert metrics.truncate_after(str(path), 5) == 0


# ---------------------------------------------------------------------- item 4: one run per directory
def test_a_second_run_on_a_locked_directory_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert train_run(out, "--steps", "2") == 0
    lock = run_dir.RunLock(str(out))
    lock.acquire(print)  # another run holds it (the flock conflicts across open files, even in one process)
    try:
        before = snapshot(out)
        capsys.readouterr()
        assert train.main(["--resume", str(out), "--steps", "3"]) == 2
        err = one_error_line(capsys)
        assert "in use by another run" in err and f"pid {os.getpid()}" in err
        assert train_run(out, "--steps", "2", "--overwrite") == 2
        assert "in use by another run" in one_error_line(capsys)
        assert snapshot(out) == before
    finally:
        lock.release()
    assert not (out / run_dir.LOCK_FILE).exists()


def test_a_stale_lock_of_a_dead_run_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    assert train_run(out, "--steps", "2") == 0
    (out / run_dir.LOCK_FILE).write_text('{"pid": 999999, "host": "elsewhere"}\n')
    capsys.readouterr()
    assert train.main(["--resume", str(out), "--steps", "3", "--progress", "none"]) == 0
    assert "taking over the lock of a run that is no longer running (pid 999999 on elsewhere" in \
        capsys.readouterr().err
    assert steps_of(out) == [1, 2, 3] and not (out / run_dir.LOCK_FILE).exists()


# ---------------------------------------------------------------------- item 9: random init only when asked for
class _Boom:
    """Unpickling this creates a file: proof that a pickle was loaded."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def tiny_config(max_positions: int = 64) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": max_positions, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "tie_word_embeddings": False}


def test_a_model_directory_without_safetensors_is_refused(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(tiny_config()))
    marker = tmp_path / "unpickled"
    (model / "pytorch_model.bin").write_bytes(pickle.dumps(_Boom(str(marker))))
    out = tmp_path / "run"
    assert train_run(out, "--model", str(model), "--steps", "1") == 2
    err = one_error_line(capsys)
    assert "pytorch_model.bin" in err and "safetensors" in err and "--init random" in err
    assert not marker.exists() and not out.exists()
    (model / "pytorch_model.bin").unlink()
    assert train_run(out, "--model", str(model), "--steps", "1") == 2
    assert "no *.safetensors weights" in one_error_line(capsys)
    assert train_run(out, "--model", str(model), "--steps", "1", "--init", "random") == 0
    assert "random init: --init random" in capsys.readouterr().err


# ---------------------------------------------------------------------- item 10: what a resume may change
def test_options_that_define_the_run_cannot_change_on_resume(tmp_path, capsys):
    out = tmp_path / "run"
    assert train_run(out, "--steps", "2") == 0
    before = snapshot(out)
    other = tmp_path / "other.txt"
    other.write_text("other text " * 50)
    for args, key in [(["--seq-len", "64"], "seq_len"), (["--batch", "4"], "batch"),
                      (["--model", "shape:Llama-3.2-1B"], "model"), (["--data", str(other)], "data"),
                      (["--compute-dtype", "bf16"], "compute_dtype"), (["--weight-decay", "0.5"], "weight_decay")]:
        capsys.readouterr()
        assert train.main(["--resume", str(out), "--steps", "3"] + args) == 2, args
        err = one_error_line(capsys)
        assert f"{key} cannot change in a resumed run" in err and args[0] in err, err
        assert snapshot(out) == before
    # The same values as the run's are fine; lr and the save cadence change, and that is said.
    capsys.readouterr()
    assert train.main(["--resume", str(out), "--steps", "4", "--seq-len", "32", "--lr", "1e-3",
                       "--save-every", "1", "--progress", "none"]) == 0
    err = capsys.readouterr().err
    assert "resume: lr 0.002 -> 0.001" in err and "resume: save_every 0 -> 1" in err and "seq_len" not in err
    schedule = lr_schedule.from_config(1e-3, -1, 1, 4)
    assert [r["lr"] for r in metrics.read_metrics(str(out / "metrics.jsonl"))][2:] == [schedule.lr(3), schedule.lr(4)]
    assert sorted(os.listdir(out / "checkpoints")) == ["latest", "step-00000002", "step-00000003", "step-00000004"]


# ---------------------------------------------------------------------- item 11: positions and token ids
def test_seq_len_beyond_the_models_positions_warns(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_config(max_positions=16)))
    assert train_run(tmp_path / "run", "--model", str(config), "--steps", "1") == 0
    err = capsys.readouterr().err
    assert "warning: seq_len 32 exceeds the model's max_position_embeddings 16" in err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert any("max_position_embeddings" in n for n in summary["notes"])


def test_token_ids_outside_the_vocabulary_are_refused_before_the_first_step(tmp_path, capsys):
    ids = np.arange(1000, dtype=np.int32) % 257
    ids[700] = 5000
    np.save(tmp_path / "tokens.npy", ids)
    out = tmp_path / "run"
    assert train_run(out, "--data", str(tmp_path / "tokens.npy")) == 2
    err = one_error_line(capsys)
    assert f"{tmp_path / 'tokens.npy'} holds token id 5000" in err and "0..256" in err
    (ids % 257).astype(np.uint16).tofile(tmp_path / "tokens.bin")
    np.array([3, 70000 % 65536], dtype=np.uint16).tofile(tmp_path / "more.bin")
    assert train_run(out, "--data", str(tmp_path / "tokens.bin"), str(tmp_path / "more.bin")) == 2
    assert "more.bin holds token id 4464" in one_error_line(capsys)
    assert train_run(out, "--separator-id", "400") == 2
    assert "separator_id=400" in one_error_line(capsys)
    assert not out.exists()


# ---------------------------------------------------------------------- item 15: paths and files, one line each
def test_bad_paths_and_files_are_one_line(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    bad_utf8 = tmp_path / "bad.jsonl"
    bad_utf8.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    cases = [(["--spill-dir", "/proc/nope"], "spill_dir: cannot create /proc/nope"),
             (["--spill-dir", str(a_file)], "is a file, not a directory"),
             (["--data", str(bad_utf8)], "line 2 is not UTF-8")]
    for args, fragment in cases:
        assert train_run(tmp_path / "run", "--steps", "1", *args) == 2
        assert fragment in one_error_line(capsys), args
    for out, fragment in [("/proc/megatrain-run", "out: cannot create /proc/megatrain-run"),
                          (str(a_file), "is a file, not a directory"),
                          (str(a_file / "run"), "is a file; name a directory")]:
        assert train.main(["--out", out, "--steps", "1"] + FAST) == 2
        assert fragment in one_error_line(capsys), out
    assert sorted(os.listdir(tmp_path)) == ["a_file", "bad.jsonl"]


# ---------------------------------------------------------------------- issue 12: --spill and --spill-dir
@pytest.fixture
def spilled_kinds(monkeypatch):
    """The kinds each engine of the run kept in spill files, and where (read just before it closes).

    Only engines made during the test count: an earlier test's engine collected meanwhile closes too."""
    seen: list[tuple[tuple[str, ...], str | None, str | None]] = []
    made: set[int] = set()
    init, close = Engine.__init__, Engine.close

    def track(self, *args, **kwargs):
        made.add(id(self))
        init(self, *args, **kwargs)

    def record(self):
        if id(self) in made and getattr(self, "store", None) is not None:
            made.discard(id(self))
            seen.append((tuple(self.store.spilled), self.plan.spill_dir, getattr(self.store, "spill_root", None)))
        close(self)

    monkeypatch.setattr(Engine, "__init__", track)
    monkeypatch.setattr(Engine, "close", record)
    return seen


def test_spill_all_spills_master_m_v_and_grads(tmp_path, spilled_kinds, capsys):
    disk = tmp_path / "nvme"
    assert train_run(tmp_path / "run", "--steps", "2", "--spill", "all", "--spill-dir", str(disk)) == 0
    kinds, spill_dir, root = spilled_kinds[0]
    assert set(kinds) == {"master", "exp_avg", "exp_avg_sq", "grads"} and spill_dir == str(disk)
    assert root is not None and root.startswith(str(disk))
    assert "spilling master, m, v and grads to" in capsys.readouterr().err


def test_a_run_planned_for_a_cpu_resumes_with_a_spill(tmp_path, spilled_kinds):
    """A CPU run's plan runs AdamW on the compute thread and computes in place; resumed with --spill optimizer,
    its AdamW moves to the worker thread (which waits for the disk) and m and v spill, instead of the plan being
    refused."""
    run, disk = tmp_path / "run", tmp_path / "nvme"
    assert train_run(run, "--steps", "2") == 0
    assert train.main(["--resume", str(run), "--steps", "3", "--spill", "optimizer", "--spill-dir", str(disk),
                       "--progress", "none", "--no-plot"]) == 0
    kinds, spill_dir, _ = spilled_kinds[-1]
    assert set(kinds) == {"exp_avg", "exp_avg_sq"} and spill_dir == str(disk)


def test_spill_dir_alone_does_not_force_a_spill_and_no_spill_lands_in_the_cwd(tmp_path, spilled_kinds, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEGATRAIN_HARDWARE", str(tmp_path / "no-profile.json"))  # detect(): no disk figures
    assert train.main(["--out", "run1", "--steps", "1", "--spill-dir", str(tmp_path / "nvme")] + FAST) == 0
    assert spilled_kinds[-1][0] == ()
    # A forced spill without --spill-dir goes under the run directory, never into the current directory.
    assert train.main(["--out", "run2", "--steps", "1", "--spill", "optimizer"] + FAST) == 0
    kinds, spill_dir, _ = spilled_kinds[-1]
    assert set(kinds) == {"exp_avg", "exp_avg_sq"} and spill_dir == os.path.join("run2", "spill")
    assert sorted(os.listdir(tmp_path)) == ["run1", "run2"]  # no spill: the spill directory is not even made


def test_abbreviated_options_are_unknown(tmp_path, capsys):
    assert train.main(["--spill-d", str(tmp_path / "d"), "--out", str(tmp_path / "run")]) == 2
    assert "unrecognized arguments: --spill-d" in one_error_line(capsys)
    assert os.listdir(tmp_path) == []
