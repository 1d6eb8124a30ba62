"""megatrain-plan driven with generated bad input: one line on stderr, status 2, no traceback, no file changed.

Every generated command line holds at least one input that must be refused (an unknown or abbreviated
option, an out-of-range or malformed value, a file that is not what it should be); the files named on
the command line, an existing plan and profile among them, stay byte for byte as they were.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from megatrain.planner.commands import cli
from hypothesis_budget import examples

COMMANDS = [[], ["plan"], ["size"], ["ram"]]
GOOD = {  # enough for the command to run, so that only the bad input can stop it
    "plan": ["--model", "shape:Llama-3.2-1B", "--seq-len", "1024", "--batch", "4", "--hardware", "H100-SXM"],
    "size": ["--model", "shape:Llama-3.2-1B", "--seq-len", "1024", "--batch", "4"],
    "ram": ["--model", "shape:Llama-3.2-1B", "--seq-len", "1024", "--hardware", "H200"],
}
FREE_OPTIONS = ["--seq-len", "--batch", "--dtype", "--hardware", "--host", "--ram", "--gpu-mem", "--nvme", "--model"]
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=10)
NUMBERISH = st.one_of(st.integers(-10**15, 0).map(str), st.sampled_from(
    ["nan", "inf", "-inf", "1e400", "-0", "0x10", "", " ", "-1e-9", "12QB", "1.5.2"]))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("planfuzz")
    (root / "plan.json").write_text('{"version": 1, "num_slots": 2}\n')
    (root / "hardware.json").write_text('{"version": 1}\n')
    (root / "bad_config.json").write_text('{"model_type": "llama", "rms_norm_eps": "1e-6"}')
    (root / "not_json.json").write_text("{model")
    (root / "gpt2.json").write_text('{"model_type": "gpt2", "vocab_size": 10}')
    (root / "a_dir").mkdir()
    return root


def bad_inputs(root) -> list[list[str]]:
    r = str(root)
    return [
        ["--bogus"], ["--spill-d", r], ["--jso"], ["--seq-len", "0"], ["--seq-len", "x"], ["--batch", "-3"],
        ["--dtype", "fp7"], ["--hardware", "TPU-v9"], ["--ram", "lots"], ["--gpu-mem", "-1G"], ["--nvme", "nan"],
        ["--model", r + "/bad_config.json"], ["--model", r + "/not_json.json"], ["--model", r + "/gpt2.json"],
        ["--model", r + "/a_dir"], ["--model", "/no/such/config.json"], ["--model", "NoSuchModel-9B"],
        ["--spill", "disk"], ["--spill", "all"],  # a forced spill needs --spill-dir
    ]


def snapshot(root) -> dict[str, str]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[p] = hashlib.sha256(f.read()).hexdigest()
    return out


def run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse's refusals exit through the parser
            code = e.code
    return code, err.getvalue()


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_generated_bad_command_lines_are_one_line_and_change_nothing(files, data):
    command = data.draw(st.sampled_from(COMMANDS))
    bad = data.draw(st.sampled_from(bad_inputs(files)))
    if command and bad[0] in ("--spill", "--spill-dir") and command[0] != "plan":
        bad = ["--bogus-" + bad[0].lstrip("-")]  # --spill is plan's; elsewhere an unknown option is the bad input
    noise = data.draw(st.lists(st.tuples(st.sampled_from(FREE_OPTIONS), st.one_of(TEXT, NUMBERISH)), max_size=2))
    argv = list(command) + GOOD.get(command[0] if command else "", []) + bad
    for opt, value in noise:  # extra options may only add refusals, never rescue the bad input
        if opt not in argv:
            argv += [opt, value]
    before = snapshot(files)
    code, err = run(argv)
    assert code == 2, (argv, code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatrain-plan: error:"), (argv, err)
    assert "Traceback" not in err
    assert snapshot(files) == before


def test_profile_into_an_unwritable_place_is_refused_before_measuring(files):
    code, err = run(["profile", "--out", str(files / "a_dir" / "no" / "such" / "x.json"), "--spill-dir", "/proc/nope"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
