"""Benchmarks never write over an earlier run's results: each run takes a name of its own (result_files.new_base)."""
from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from result_files import new_base  # noqa: E402


def test_a_run_takes_the_first_name_whose_json_and_markdown_are_both_free(tmp_path):
    base = str(tmp_path / "2026-01-01_cpu_thing")
    assert new_base(base) == base
    (tmp_path / "2026-01-01_cpu_thing.json").write_text("{}")
    assert new_base(base) == base + "_2"
    (tmp_path / "2026-01-01_cpu_thing_2.md").write_text("a table alone still holds the name")
    assert new_base(base) == base + "_3"
    assert (tmp_path / "2026-01-01_cpu_thing.json").read_text() == "{}"


def test_every_benchmark_that_writes_a_result_chooses_its_name_through_new_base():
    writes = re.compile(r"open\((stem|base) \+ \"\.(json|md)\", \"w\"")
    writers = [p for p in (ROOT / "benchmarks").glob("*.py") if writes.search(p.read_text())]
    assert len(writers) >= 15, [p.name for p in writers]
    fixed = [p.name for p in writers if "new_base(" not in p.read_text()]
    assert not fixed, f"these write results under a fixed name, over an earlier run's: {fixed}"
