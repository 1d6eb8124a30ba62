"""megatrain-train driven with generated bad input: one line on stderr, status 2, no traceback, nothing changed.

Every generated command line holds at least one input that must be refused (an unknown or malformed
option, an out-of-range value, a bad file), and names an existing run directory as --out; whatever
the command refuses first, the run directory and the input files stay byte for byte as they were.
"""
from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from megatrain.tools import train
from hypothesis_budget import examples

FAST = ["--seq-len", "32", "--batch", "2", "--progress", "none", "--no-plot"]
# Options whose value may be anything: they never name a path, so no generated value reaches the disk.
FREE_OPTIONS = ["--seq-len", "--batch", "--lr", "--min-lr", "--warmup-steps", "--weight-decay", "--beta1", "--beta2",
                "--max-grad-norm", "--steps", "--tokens", "--save-every", "--keep", "--separator-id", "--seed",
                "--compute-dtype", "--device", "--progress", "--log-every", "--token-dtype", "--spill", "--init",
                "--text-field"]
ARG_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
NUMBERISH = st.one_of(st.integers(-10**12, 10**12).map(str), st.sampled_from(
    ["nan", "inf", "-inf", "1e400", "-0", "0x10", "1_000", "", " ", "3.5", "-1e-9"]))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """An existing run, and bad input files beside it."""
    root = tmp_path_factory.mktemp("fuzz")
    run = root / "run1"
    assert train.main(["--out", str(run), "--steps", "2"] + FAST) == 0
    files = root / "inputs"
    files.mkdir()
    (files / "bad_utf8.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    (files / "not_json.jsonl").write_text("{text: 1}\n")
    (files / "no_field.jsonl").write_text('{"body": "x"}\n')
    (files / "empty.jsonl").write_text("")
    np.save(files / "big_ids.npy", np.array([1, 2, 100000], dtype=np.int64))
    np.save(files / "floats.npy", np.zeros(4, dtype=np.float32))
    (files / "odd.bin").write_bytes(b"\x01\x02\x03")
    (files / "garbage.parquet").write_bytes(b"not parquet")
    (files / "bad.toml").write_text("steps = [\n")
    (files / "overwrite.toml").write_text("overwrite = true\n")
    (files / "plan.json").write_text('{"num_slots": 1}')
    (files / "tokenizer.json").write_text("{}")
    (files / "a_file").write_text("x")
    (files / "short.json").write_text(
        '{"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, '
        '"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16}')
    model = files / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    return root, run, files


def bad_inputs(files) -> list[list[str]]:
    """Inputs each of which must be refused on its own."""
    f = str(files)
    return [
        ["--bogus"], ["--spill-d", "x"], ["--steps"], ["--overwrit"], ["--config", f + "/bad.toml"],
        ["--config", f + "/overwrite.toml"], ["--config", "/no/such.toml"],
        ["--data", f + "/bad_utf8.jsonl"], ["--data", f + "/not_json.jsonl"], ["--data", f + "/no_field.jsonl"],
        ["--data", f + "/empty.jsonl"], ["--data", f + "/big_ids.npy"], ["--data", f + "/floats.npy"],
        ["--data", f + "/odd.bin"], ["--data", f + "/garbage.parquet"], ["--data", "/no/such/dir"],
        ["--model", f + "/model"], ["--model", f + "/a_file"], ["--model", "NoSuchModel-9B"],
        ["--tokenizer", f + "/tokenizer.json"], ["--plan", f + "/plan.json"], ["--resume", f + "/a_file"],
        ["--resume", f], ["--spill-dir", "/proc/nope"], ["--spill-dir", f + "/a_file"],
        ["--separator-id", "100000"], ["--seq-len", "1"], ["--batch", "0"], ["--lr", "nan"], ["--lr", "-1"],
        ["--model", f + "/short.json", "--data", f + "/bad_utf8.jsonl"],  # a warning too: said only if it runs
        ["--beta2", "1"], ["--spill", "disk"], ["--init", "zeros"], ["--compute-dtype", "fp8"],
    ]


def snapshot(*roots) -> dict[str, str]:
    out = {}
    for root in roots:
        for base, dirs, names in os.walk(root):
            out.update({os.path.join(base, d) + "/": "dir" for d in dirs})
            for name in names:
                with open(os.path.join(base, name), "rb") as fh:
                    out[os.path.join(base, name)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_generated_bad_command_lines_are_one_line_and_change_nothing(world, capsys, data):
    root, run, files = world
    argv = list(data.draw(st.sampled_from(bad_inputs(files)), label="bad"))
    for _ in range(data.draw(st.integers(0, 2), label="extra options")):
        option = data.draw(st.sampled_from(FREE_OPTIONS), label="option")
        argv += [option, data.draw(st.one_of(NUMBERISH, ARG_TEXT), label="value")]
    if data.draw(st.booleans(), label="out first"):
        argv = ["--out", str(run)] + argv
    else:
        argv = argv + ["--out", str(run)]
    before = snapshot(root)
    capsys.readouterr()
    assert train.main(argv + FAST) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatrain-train: error: "), (argv, err)
    assert "Traceback" not in err
    assert snapshot(root) == before, argv


@pytest.mark.parametrize("argv, fragment", [
    (["--spill-dir", "/proc/nope"], "spill_dir: cannot create /proc/nope"),
    (["--spill-d", "d"], "unrecognized arguments: --spill-d"),
    (["--out", "/proc/megatrain-run"], "out: cannot create /proc/megatrain-run"),
])
def test_the_command_in_a_subprocess(tmp_path, argv, fragment):
    proc = subprocess.run([sys.executable, "-m", "megatrain.tools.train"] + argv, capture_output=True, text=True,
                          cwd=tmp_path, timeout=180)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and fragment in proc.stderr, proc.stderr
    assert os.listdir(tmp_path) == []


def test_ctrl_c_during_start_up_exits_130_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    class Interrupted:
        def __init__(self, *args, **kwargs):
            raise KeyboardInterrupt

    monkeypatch.setattr(train, "Engine", Interrupted)
    out = tmp_path / "run"
    assert train.main(["--out", str(out), "--steps", "2", "--spill", "optimizer"] + FAST) == 130
    err = capsys.readouterr().err
    assert err.strip() == "megatrain-train: interrupted before training started" and "Traceback" not in err
    assert os.listdir(tmp_path) == []  # the run directory it made (and its spill directory) are gone again


def _reader_waiting(fifo, proc: subprocess.Popen, timeout: float = 120) -> int:
    """Once the command has the FIFO open to read its data: a write end, held open (nothing written: the read
    waits on), so that a signal lands while the data is read."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO until a reader has it open
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
        time.sleep(0.05)
    raise AssertionError(f"the command never opened its data (status {proc.poll()})")


@pytest.mark.parametrize("when", ["modules load", "data is read"])
def test_ctrl_c_while_starting_is_one_line_130(tmp_path, when):
    """Whether it lands while modules load (0.3 s in) or while the data is read (a FIFO nobody writes: start-up
    never ends)."""
    fifo = tmp_path / "stalled.txt"
    os.mkfifo(fifo)
    # Ctrl-C's default action in the child, as at a terminal, even where the suite runs as a background job without
    # job control (whose children inherit SIGINT ignored)
    proc = subprocess.Popen([sys.executable, "-m", "megatrain.tools.train", "--data", str(fifo), "--out",
                             str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    writer = None
    if when == "modules load":
        time.sleep(0.3)
    else:
        writer = _reader_waiting(fifo, proc)
    try:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if writer is not None:
            os.close(writer)
    assert proc.returncode == 130 and err.strip() == "megatrain-train: interrupted before training started", err
    assert sorted(os.listdir(tmp_path)) == ["stalled.txt"]


# Values no option should take to a traceback or a hang: past any machine, zero, negative, not finite, not a number.
EXTREMES = st.sampled_from(["99999999999999999999", "1000000000", "1e308", "-1e308", "0", "-1", "nan", "inf", "-inf",
                            "abc", "", "1e-400", "0x10", "../../outside", "/etc/passwd"])
# Numeric options a generated value goes to (--steps is fixed last: a huge count would just train on).
NUMERIC_OPTIONS = ["--seq-len", "--batch", "--lr", "--min-lr", "--warmup-steps", "--weight-decay", "--beta1",
                   "--beta2", "--max-grad-norm", "--save-every", "--keep", "--separator-id", "--seed", "--log-every",
                   "--eval-fraction", "--eval-every", "--collective-timeout"]
# Paths outside the run directory, each one the command reads (never writes) or must refuse.
OUTSIDE_PATHS = [["--plan", "/etc/passwd"], ["--tokenizer", "/etc/hostname"], ["--config", "/etc/passwd"],
                 ["--resume", "/etc"], ["--model", "/etc"], ["--spill-dir", "/proc/megatrain-spill"],
                 ["--export-on-finish", "/etc"], ["--eval-data", "/no/such/file"], ["--tokens", "0"],
                 ["--tokens", "-5"], ["--tokens", "nan"]]


class _Hang(BaseException):
    """Raised by the alarm: the command ran past its bound."""


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_extreme_option_values_are_one_line_bounded_and_touch_nothing_outside_out(world, capsys, data):
    """Each example: one to three options with extreme values (and maybe a path outside), a fresh --out. The
    command trains (status 0, 3) or refuses in one line (status 2), within a bound, and changes no file but
    --out's."""
    root, _, _ = world
    argv: list[str] = []
    for _ in range(data.draw(st.integers(1, 3), label="options")):
        argv += [data.draw(st.sampled_from(NUMERIC_OPTIONS), label="option"), data.draw(EXTREMES, label="value")]
    if data.draw(st.booleans(), label="outside path"):
        argv += data.draw(st.sampled_from(OUTSIDE_PATHS), label="path")
    out = root / f"fresh-{len(os.listdir(root))}"
    before = snapshot(root)
    capsys.readouterr()

    def hang(*_):
        raise _Hang(argv)

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(90)  # far past any refusal (about a second) or a one-step demo run
    try:
        code = train.main(argv + ["--out", str(out)] + FAST + ["--steps", "1"])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    err = capsys.readouterr().err
    assert "Traceback" not in err, (argv, err)
    assert code in (0, 2, 3), (argv, code, err)
    if code == 2:
        assert err.count("\n") == 1 and err.startswith("megatrain-train: error: "), (argv, err)
        assert not out.exists(), argv
    after = {k: v for k, v in snapshot(root).items() if not k.startswith(str(out))}
    assert after == before, argv
