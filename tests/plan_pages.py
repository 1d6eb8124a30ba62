"""megatrain-plan run once in-process, its answer read as both pages: the JSON and the text.

Each command builds both pages and ``--json`` only chooses which ``report.emit`` prints. A test that checks both
(``--json`` for the figures, the text for its wording) ran the whole search twice, a subprocess each (up to 45 s
of CPU for the overview of every preset); ``pages`` runs the command once through ``cli.main`` and prints the one
answer both ways through the real ``report.emit``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from megatrain.planner.commands import cli, report


@dataclass(frozen=True)
class Pages:
    """One run's exit status, its answer as ``--json`` prints it (parsed) and as the text prints it, its stderr."""

    rc: int
    data: Any
    text: str
    err: str


def pages(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: str) -> Pages:
    """``megatrain-plan *argv`` (with or without ``--json``) once; a run that fails has no pages (data None)."""
    emit, answers = report.emit, []
    with monkeypatch.context() as m:
        m.setattr(report, "emit", lambda as_json, data, text: answers.append((as_json, data, text)))
        rc = cli.main(list(argv))
    err = capsys.readouterr().err
    if rc != 0:
        return Pages(rc, None, "", err)
    [(as_json, data, text)] = answers  # one answer a run
    assert as_json == ("--json" in argv)
    emit(True, data, text)
    as_printed = json.loads(capsys.readouterr().out)
    emit(False, data, text)
    return Pages(rc, as_printed, capsys.readouterr().out, err)
