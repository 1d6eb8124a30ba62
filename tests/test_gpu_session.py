"""benchmarks/gpu_session.sh checked without a GPU: its syntax, its dry run (every part's commands, in the order
asked, nothing written), the estimates its header states against the ones it sums, and every option its
commands pass to the benchmark scripts and to megatrain-train existing there."""
from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest

from megatrain.tools.train_options import build_parser

ROOT = os.path.join(os.path.dirname(__file__), "..")
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_session.sh")
PRIORITY = ["flagship", "compiled", "peers1b", "peers3b", "calibrate", "validation", "moe", "largest", "seq8192", "racecheck"]


def dry(*parts: str, tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path / "out"), KEEP=str(tmp_path / "keep"))
    return subprocess.run(["bash", SCRIPT, *parts], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def test_syntax():
    assert subprocess.run(["bash", "-n", SCRIPT], capture_output=True).returncode == 0


def test_dry_run_prints_each_part_in_order_and_writes_nothing(tmp_path):
    r = dry(*PRIORITY, tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    said = re.findall(r"^== part (\S+) \(estimate (\d+) s\)", r.stdout, re.M)
    assert [p for p, _ in said] == PRIORITY
    total = int(re.search(r"estimate for this call: (\d+) s", r.stdout).group(1))
    assert total == sum(int(s) for _, s in said)
    # the header states each part's estimate as the script sums it
    header = open(SCRIPT).read().split("set -uo pipefail")[0]
    for part, seconds in said:
        assert re.search(rf"^#   {part} +{seconds} ", header, re.M), (part, seconds)
    assert not (tmp_path / "out").exists() and not (tmp_path / "keep").exists()
    # planner is calibrate then validation; an unknown part is refused before anything runs
    assert re.findall(r"^== part (\S+)", dry("planner", tmp_path=tmp_path).stdout, re.M) == ["calibrate", "validation"]
    bad = dry("flagship", "nope", tmp_path=tmp_path)
    assert bad.returncode == 2 and "unknown part 'nope'" in bad.stderr and "== part" not in bad.stdout


def test_every_option_the_commands_pass_exists(tmp_path):
    out = dry(*PRIORITY, tmp_path=tmp_path).stdout
    train = set(build_parser()._option_string_actions)
    sources = {"peers.py": ["peers.py", "peer_runners/cli.py"]}
    checked = 0
    for line in out.splitlines():
        words = shlex.split(line[2:]) if line.startswith("+ ") else []
        if "python3" not in words or not words[words.index("python3") + 1].startswith("benchmarks/"):
            continue  # the venv's set-up, python3 -c, megatrain-plan through sh -c
        script, args = words[words.index("python3") + 1], words[words.index("python3") + 2:]
        if "--" in args:  # train_watch.py's options, then the megatrain-train command after --
            cut = args.index("--")
            args, command = args[:cut], args[cut + 1:]
            assert command[0] == "megatrain-train"
            for flag in (w for w in command if w.startswith("--")):
                assert flag in train, (flag, line)
                checked += 1
        name = os.path.basename(script)
        text = "".join(open(os.path.join(ROOT, "benchmarks", f)).read() for f in sources.get(name, [name]))
        for flag in (w for w in args if w.startswith("--")):
            assert f'"{flag}"' in text, (flag, name)
            checked += 1
    assert checked > 40


@pytest.mark.parametrize("part", ["largest", "moe"])
def test_training_parts_stop_before_the_final_checkpoint(part, tmp_path):
    """megatrain-train's final checkpoint does not fit the GPU machine's disk for these runs: each runs under
    train_watch, stopped after its 6th of 6 steps, with its folder in KEEP (packed), never under OUT."""
    out = dry(part, tmp_path=tmp_path).stdout
    (line,) = [x for x in out.splitlines() if "megatrain-train" in x and "train_watch.py" in x]
    words = shlex.split(line[2:])
    assert words[words.index("--stop-after") + 1] == words[words.index("--steps") + 1] == "6"
    run_dir = words[words.index("--run-dir") + 1]
    assert run_dir == words[words.index("--out") + 1] and run_dir.startswith(str(tmp_path / "keep"))


def test_the_compiled_part_times_the_probe_and_the_flagship_both_ways(tmp_path):
    """``compiled``: the profile's probe of one 8B layer (its JSON into KEEP), then the flagship's run as two
    step-anatomy variants that differ in ``Plan.compiled_layers`` alone, the same command otherwise."""
    out = dry("compiled", tmp_path=tmp_path).stdout
    (probe,) = [x for x in out.splitlines() if "compiled_layer_probe" in x]
    words = shlex.split(probe[2:])  # sh -c 'python3 -m ... >"$1"' sh FILE, as the dry run prints it (unquoted)
    assert words[:5] == ["sh", "-c", "python3", "-m", "megatrain.tools.compiled_layer_probe"]
    source = open(os.path.join(ROOT, "tools", "compiled_layer_probe.py")).read()
    assert all(f'"{flag}"' in source for flag in words if flag.startswith("--"))
    assert words[-1] == str(tmp_path / "keep" / "compiled_layer_probe.json")
    runs = [shlex.split(x[2:]) for x in out.splitlines() if "step_anatomy.py" in x]  # one process each
    assert [w[w.index("--variant") + 1] for w in runs] == ["uncompiled", "compiled"]
    assert all(w[:w.index("--variant")] == runs[0][:runs[0].index("--variant")] for w in runs)
    text = open(os.path.join(ROOT, "benchmarks", "step_anatomy.py")).read()
    assert '"uncompiled": {"compiled_layers": False}' in text and '"compiled": {"compiled_layers": True}' in text
