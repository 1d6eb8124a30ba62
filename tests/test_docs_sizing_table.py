"""docs/sizing.md's table of what one H200 trains is megatrain-plan size's H200 row for each model, as printed."""
from __future__ import annotations

import re

import pytest

from doc_pages import ROOT
from megatrain.planner.commands import cli

SIZING = ROOT / "docs" / "sizing.md"
COMMAND = ["size", "--hardware", "H200", "--ram", "1.5T", "--seq-len", "4096", "--batch", "16"]


def table_rows() -> list[list[str]]:
    section = SIZING.read_text().split("## What one H200 trains", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| ")]
    assert rows[0][0] == "model" and len(rows) >= 6, rows
    return rows[1:]


def test_the_table_names_the_command_it_comes_from():
    assert "`megatrain-plan size --model M --hardware H200 --ram 1.5T --seq-len 4096 --batch 16`" in \
        " ".join(SIZING.read_text().split())


@pytest.mark.parametrize("row", table_rows(), ids=lambda row: row[0])
def test_each_row_is_what_size_prints(row, monkeypatch, tmp_path, capsys):
    model, needs, nvme, step, throughput, bound = row
    argv = COMMAND + ["--model", "shape:" + model.split(" (")[0].split(",")[0]]
    if "--optimizer-state bf16" in model:
        argv += ["--optimizer-state", "bf16"]
    monkeypatch.setenv("MEGATRAIN_HARDWARE", str(tmp_path / "no-profile.json"))
    assert cli.main(argv) == 0
    h200 = [line for line in capsys.readouterr().out.splitlines() if line.startswith("H200 ")]
    assert len(h200) == 1, h200
    printed = re.split(r"\s{2,}", h200[0].strip())
    # GPU preset, host RAM, run needs, NVMe, disk/step, step, throughput, MFU, bound by
    assert printed[2] == needs and printed[5] == step and printed[6] == throughput and printed[-1] == bound, printed
    assert printed[3] == (nvme if nvme != "0" else "0.0 GiB"), printed
