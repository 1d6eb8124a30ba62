"""Every Python example in README.md and docs/ runs as written; the own-loop example trains and prints its steps."""
from __future__ import annotations

import math

import pytest

from doc_pages import ROOT, code_blocks

BLOCKS = code_blocks("python")


def test_the_pages_hold_the_python_examples():
    assert {page.name for page, _ in BLOCKS} >= {"api.md", "nvme.md"}


@pytest.mark.parametrize("page,code", BLOCKS, ids=lambda v: v.name if hasattr(v, "name") else "code")
def test_python_example_runs(page, code, capsys):
    exec(compile(code, str(page.relative_to(ROOT)), "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    if "engine.step(" in code:   # the own loop prints step, loss and gradient norm for each of its 3 steps
        assert len(lines) == 3, lines
        for step, line in enumerate(lines):
            fields = line.split()
            assert len(fields) == 3 and int(fields[0]) == step, line
            assert all(math.isfinite(float(v)) and float(v) > 0 for v in fields[1:]), line
