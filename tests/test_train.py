"""megatrain-train (tools/train.py): the demo end to end, config and CLI errors, data formats, resume, Ctrl-C."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from megatrain.runtime import Engine
from megatrain.tools import interrupt, lr_schedule, train, train_config, train_options
from megatrain.tools.data import Corpus
from megatrain.tools.tokenizer import ByteTokenizer, load as load_tokenizer

SMALL = ["--seq-len", "64", "--batch", "4", "--progress", "plain", "--no-plot"]


def read_metrics(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_demo_end_to_end_loss_falls(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert train.main(["--steps", "24", "--out", out, "--log-every", "8"] + SMALL) == 0
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, 25))
    for key in ("step", "loss", "tokens_per_second", "lr", "grad_norm", "tokens", "host_memory_bytes"):
        assert key in records[0]
    losses = [r["loss"] for r in records]
    assert np.mean(losses[-4:]) < losses[0] - 1.0, losses
    # Warmup then cosine decay: rises to the peak, ends at the floor.
    lrs = [r["lr"] for r in records]
    assert max(lrs) == pytest.approx(2e-3) and lrs[-1] == pytest.approx(2e-4)
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["steps"] == 24 and summary["tokens_per_second"] > 0 and summary["model_tflops"] > 0
    err = capsys.readouterr().err
    assert "tokens/s" in err and "TFLOP/s" in err and "peak host RSS" in err and "MFU" in err
    engine = Engine.load_checkpoint(os.path.join(out, "checkpoints"))
    assert engine.checkpoint_extra["step"] == 24 and engine.step_count == 24
    engine.close()


def test_resume_continues_the_same_run(tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    common = ["--warmup-steps", "2"] + SMALL + ["--progress", "none"]
    assert train.main(["--steps", "6", "--out", straight] + common) == 0
    assert train.main(["--steps", "6", "--out", split, "--save-every", "3"] + common) == 0
    ckpt_root = os.path.join(split, "checkpoints")
    step3 = os.path.join(ckpt_root, "step-00000003")
    assert os.path.isdir(step3)
    resumed = str(tmp_path / "resumed")
    assert train.main(["--resume", step3, "--out", resumed, "--progress", "none"]) == 0
    a = [r["loss"] for r in read_metrics(straight)]
    b = [r["loss"] for r in read_metrics(resumed)]
    assert [r["step"] for r in read_metrics(resumed)] == [4, 5, 6]
    # Same data position, schedule and state: the same losses as the uninterrupted run (fp32 on CPU).
    assert b == a[3:]


def test_schedule_warmup_and_cosine():
    s = lr_schedule.from_config(1.0, -1, 10, 110)
    assert s.lr(5) == pytest.approx(0.5) and s.lr(10) == pytest.approx(1.0)
    assert s.lr(60) == pytest.approx(0.55) and s.lr(110) == pytest.approx(0.1) and s.lr(500) == pytest.approx(0.1)
    assert lr_schedule.from_config(1.0, 0.0, -1, 50).warmup_steps == 5


@pytest.mark.parametrize("argv, fragment", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--steps", "many"], "--steps: invalid int value"),
    (["--seq-len", "1"], "seq_len=1 must be >= 2"),
    (["--lr", "-1"], "lr=-1.0"),
    (["--compute-dtype", "fp16"], "invalid choice: 'fp16'"),
    (["--data", "/no/such/file.jsonl"], "data: /no/such/file.jsonl does not exist"),
    (["--model", "NoSuchModel-7B"], "unknown model 'NoSuchModel-7B'"),
    (["--plan", "/no/plan.json"], "plan: /no/plan.json does not exist"),
    (["--config", "/no/run.toml"], "cannot read config file /no/run.toml"),
])
def test_cli_errors_are_one_line_status_2(argv, fragment, capsys, tmp_path):
    assert train.main(argv + ["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatrain-train: error: ") and fragment in err, err


def test_toml_config_command_line_overrides_and_unknown_keys(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello world")
    cfg = tmp_path / "run.toml"
    cfg.write_text('steps = 40\nseq_len = 32\nbatch = 2\ndata = ["notes.txt"]\nplot = false\n')
    config = train_options.parse(["--config", str(cfg), "--steps", "7"])
    assert (config.steps, config.seq_len, config.batch, config.plot) == (7, 32, 2, False)
    assert config.data == (str(tmp_path / "notes.txt"),)  # relative to the file
    for text, fragment in [("seq-len = 32\n", "unknown key 'seq-len'; did you mean 'seq_len'?"),
                           ("stepz = 3\n", "unknown key 'stepz'; valid keys: model, revision, init, data"),
                           ('steps = "ten"\n', "steps = 'ten' should be an integer"),
                           ("steps = [\n", "is not valid TOML")]:
        cfg.write_text(text)
        assert train.main(["--config", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and fragment in err, err


def test_cli_error_in_a_subprocess_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatrain.tools.train", "--batch", "0"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == "megatrain-train: error: batch=0 must be >= 1\n"


def test_data_formats(tmp_path):
    tok = ByteTokenizer()
    (tmp_path / "a.txt").write_text("ab")
    (tmp_path / "b.jsonl").write_text('{"text": "cd"}\n\n{"text": "e"}\n')
    np.save(tmp_path / "c.npy", np.array([[1, 2], [3, 4]], dtype=np.int32))
    np.array([7, 8, 9], dtype=np.uint16).tofile(tmp_path / "d.bin")
    (tmp_path / "ignored.csv").write_text("x")
    docs = [d.tolist() for d in Corpus((str(tmp_path),), tok).documents()]
    assert docs == [[97, 98], [99, 100], [101], [1, 2], [3, 4], [7, 8, 9]]
    (tmp_path / "bad.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(train_config.TrainConfigError, match="line 1 has no string field 'text'"):
        list(Corpus((str(tmp_path / "bad.jsonl"),), tok).documents())
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(train_config.TrainConfigError, match="not a whole number of uint16 tokens"):
        list(Corpus((str(tmp_path / "odd.bin"),), tok).documents())


def test_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<|endoftext|>": 3}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert loaded.encode("hello world") == [1, 2] and loaded.separator_id == 3 and loaded.vocab_size == 4
    (tmp_path / "t.jsonl").write_text('{"text": "hello world hello"}\n' * 40)
    out = str(tmp_path / "run")
    # The demo model's vocabulary is sized to the tokenizer's.
    assert train.main(["--tokenizer", str(tmp_path / "tokenizer.json"), "--data", str(tmp_path / "t.jsonl"),
                       "--steps", "3", "--out", out, "--seq-len", "16", "--batch", "2", "--progress", "none",
                       "--no-plot"]) == 0
    assert len(read_metrics(out)) == 3


def test_trace_writes_a_chrome_trace(tmp_path):
    out = str(tmp_path / "run")
    assert train.main(["--steps", "4", "--out", out, "--trace"] + SMALL) == 0
    with open(os.path.join(out, "trace.json")) as f:
        trace = json.load(f)
    names = {e.get("name", "") for e in trace["traceEvents"]}
    for label in ("fwd[", "bwd[", "head[", "h2d[", "d2h[", "adam["):  # adam: the worker thread is traced too
        assert any(n.startswith(label) for n in names), (label, sorted(names)[:20])


def test_interrupt_guard_first_asks_second_exits(monkeypatch):
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite runs as a background job without job control
    exits = []
    monkeypatch.setattr(interrupt.os, "_exit", lambda code: exits.append(code))
    with interrupt.InterruptGuard() as guard:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert guard.requested and not exits
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert exits == [130]
    assert signal.getsignal(signal.SIGINT) is before


def test_ctrl_c_saves_a_loadable_checkpoint_and_exits_130(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "megatrain.tools.train", "--steps", "100000", "--out", str(out),
                             "--log-every", "1"] + SMALL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 90
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "checkpoint saved" in err
    steps = len(metrics.read_text().splitlines())
    engine = Engine.load_checkpoint(str(out / "checkpoints"))
    assert engine.checkpoint_extra["step"] == steps == engine.step_count
    engine.close()
    assert json.load(open(out / "summary.json"))["exit_code"] == 130


def test_megatrain_train_skips_non_finite_updates_by_default():
    """The training command's optimizer skips a step whose gradient is not finite (the API's default does not)."""
    from megatrain.tools import train as train_module
    from megatrain.tools.train_config import TrainConfig

    assert train_module._optimizer(TrainConfig()).skip_nonfinite is True
