"""benchmarks/results/README.md is the index results_index.py writes for the files present: every run listed, newest
first within its benchmark and device."""
from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import results_index  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def test_the_committed_index_is_up_to_date():
    assert (RESULTS / "README.md").read_text() == results_index.render(), \
        "benchmarks/results/README.md is out of date: run python benchmarks/results_index.py"
    assert results_index.main(["--check"]) == 0


def test_every_results_file_is_linked_once_and_every_link_lands():
    text = (RESULTS / "README.md").read_text()
    files = sorted(p.name for p in RESULTS.iterdir() if p.name != "README.md")
    rows = [line for line in text.splitlines() if line.startswith("| 20")]
    linked = [name for row in rows for name in re.findall(r"\]\(([^)#]+)\)", row)]
    assert sorted(linked) == files


def test_runs_are_grouped_by_benchmark_and_device_newest_first(tmp_path):
    for name in ["2026-01-02_cpu_own_loop_25m.json", "2026-01-02_cpu_own_loop_25m.md", "2026-01-05_cpu_own_loop_cli_25m.md",
                 "2026-01-03_NVIDIA-H200_throughput_1b.json", "2026-01-07_H200_throughput_1b.md",
                 "2026-01-04_cpu_own_loop_100m.md", "2026-01-06_H200_hardware.json"]:
        (tmp_path / name).write_text("# t\n")
    text = results_index.render(tmp_path)
    sections = re.split(r"^## ", text, flags=re.M)
    by_heading = {s.splitlines()[0]: s for s in sections[1:]}
    own_loop = by_heading["own_loop, cpu"]
    assert own_loop.index("2026-01-04_cpu_own_loop_100m") < own_loop.index("2026-01-02_cpu_own_loop_25m.md")
    assert "own_loop_cli" not in own_loop and "2026-01-05" in by_heading["own_loop_cli, cpu"]
    throughput = by_heading["throughput, H200"]          # the vendor prefix is the same device
    assert throughput.index("2026-01-07") < throughput.index("2026-01-03")
    assert "hardware profile (megatrain-plan profile), H200" in by_heading
    newest = by_heading["Newest run of each benchmark on each device"]
    assert "[2026-01-04_cpu_own_loop_100m](2026-01-04_cpu_own_loop_100m.md) | 2 |" in newest
