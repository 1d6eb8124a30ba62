"""benchmarks/train_watch.py: a run stopped by Ctrl-C twice once its metrics have N rows (no final checkpoint
waited for), SIGKILL where it ignores them, the disk it filled sampled, and a run's own exit status kept."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap

PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "train_watch.py")

# A stand-in for megatrain-train: a metrics row every 50 ms, 1 MiB written to its spill folder first; after a
# first Ctrl-C it "writes a checkpoint" (sleeps) and only a second one ends it (exit 130), as megatrain-train's.
CHILD = textwrap.dedent("""
    import os, signal, sys, time
    out, spill, ignore = sys.argv[1], sys.argv[2], sys.argv[3] == "ignore"
    asked = []
    def handle(signum, frame):
        asked.append(signum)
        if len(asked) >= 2:
            os._exit(130)
    signal.signal(signal.SIGINT, signal.SIG_IGN if ignore else handle)
    os.makedirs(spill, exist_ok=True)
    with open(os.path.join(spill, "exp_avg.bin"), "wb") as f:
        f.write(b"\\1" * (1 << 20))
    for i in range(400):
        with open(os.path.join(out, "metrics.jsonl"), "a") as f:
            f.write('{"step": %d}\\n' % (i + 1))
        time.sleep(10 if asked else 0.05)
""")


def load():
    spec = importlib.util.spec_from_file_location("train_watch", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(mod, tmp_path, mode: str, stop_after: int = 3) -> tuple[int, dict]:
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    (tmp_path / "run").mkdir(exist_ok=True)
    record = tmp_path / "watch.json"
    code = mod.main(["--stop-after", str(stop_after), "--run-dir", str(tmp_path / "run"), "--watch",
                     str(tmp_path / "spill"), "--record", str(record), "--interval", "0.05", "--",
                     sys.executable, str(child), str(tmp_path / "run"), str(tmp_path / "spill"), mode])
    return code, json.loads(record.read_text())


def test_stops_the_run_after_its_rows_with_two_ctrl_c(tmp_path):
    code, rec = run(load(), tmp_path, "handle")
    assert code == 0 and rec["exit_code"] == 130 and rec["stopped_after_rows"] == 3
    assert 3 <= rec["rows"] < 400  # stopped, not run to its end
    assert rec["peak_allocated_bytes"][str(tmp_path / "spill")] >= 1 << 20
    assert rec["least_free_bytes"] > 0


def test_kills_a_run_that_ignores_ctrl_c(tmp_path, monkeypatch):
    mod = load()
    monkeypatch.setattr(mod, "GRACE_S", 0.5)
    code, rec = run(mod, tmp_path, "ignore")
    assert code == 0 and rec["exit_code"] == -9 and rec["stopped_after_rows"] == 3 and rec["rows"] < 400


def test_a_run_that_ends_first_keeps_its_exit_status(tmp_path):
    mod = load()
    record = tmp_path / "w.json"
    code = mod.main(["--stop-after", "6", "--run-dir", str(tmp_path), "--record", str(record), "--",
                     sys.executable, "-c", "import sys; sys.exit(3)"])
    rec = json.loads(record.read_text())
    assert code == 3 and rec["exit_code"] == 3 and rec["stopped_after_rows"] is None and rec["rows"] == 0
