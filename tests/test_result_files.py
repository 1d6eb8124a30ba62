"""Benchmarks never write over an earlier run's results: each run takes a name of its own (result_files.new_base),
through the one results writer (result_files.write_report), and describes its machine one way (result_files.machine)."""
from __future__ import annotations

import pathlib
import json
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from result_files import machine, new_base, write_report  # noqa: E402


def test_a_run_takes_the_first_name_whose_json_and_markdown_are_both_free(tmp_path):
    base = str(tmp_path / "2026-01-01_cpu_thing")
    assert new_base(base) == base
    (tmp_path / "2026-01-01_cpu_thing.json").write_text("{}")
    assert new_base(base) == base + "_2"
    (tmp_path / "2026-01-01_cpu_thing_2.md").write_text("a table alone still holds the name")
    assert new_base(base) == base + "_3"
    assert (tmp_path / "2026-01-01_cpu_thing.json").read_text() == "{}"


def test_a_report_is_written_as_json_and_markdown_under_a_new_name_each_run(tmp_path, capsys):
    base = str(tmp_path / "results" / "2026-01-01_cpu_thing")
    first = write_report(base, {"rows": [1, 2]}, ["# Thing", "", "| a |"])
    second = write_report(base, {"rows": [3]}, "# Thing again\n")
    assert (first, second) == (base, base + "_2")
    assert json.loads(pathlib.Path(first + ".json").read_text()) == {"rows": [1, 2]}
    assert pathlib.Path(first + ".md").read_text() == "# Thing\n\n| a |\n"
    assert pathlib.Path(second + ".md").read_text() == "# Thing again\n"
    out = capsys.readouterr()
    assert out.out == "# Thing\n\n| a |\n# Thing again\n" and f"wrote {second}.json and .md" in out.err


def test_the_machine_description_names_the_cpu_and_the_host():
    info = machine()
    assert info["cores"] >= 1 and info["cpu"] and info["python"].count(".") == 2 and info["torch"]
    assert info["host_ram_gib"] > 0


def test_every_benchmark_that_writes_a_result_goes_through_the_results_writer():
    files = [p for p in (ROOT / "benchmarks").rglob("*.py") if p.name != "result_files.py"]
    writes = re.compile(r"open\((stem|base) \+ \"\.(json|md)\", \"w\"|write_report\(")
    # the scripts; peers.py's report (peer_runners/report.py) is one file a day that --resume goes on writing
    writers = [p for p in files if p.parent.name == "benchmarks" and writes.search(p.read_text())]
    assert len(writers) >= 15, [p.name for p in writers]
    fixed = [p.name for p in writers if "write_report(" not in p.read_text() and "new_base(" not in p.read_text()]
    assert not fixed, f"these write results under a fixed name, over an earlier run's: {fixed}"
    own = [p.name for p in files if re.search(r"^def (machine|new_base|write_report)\(", p.read_text(), re.M)]
    assert not own, f"these describe the machine or write results their own way, beside result_files.py: {own}"
