"""Every megatrain-plan command in README.md and docs/ runs as written (exit 0)."""
from __future__ import annotations

import pytest

from doc_pages import commands
from megatrain.planner.commands import cli
from megatrain.planner.profiling import profiler

PLAN_COMMANDS = [argv for _, argv in commands("megatrain-plan")]


def test_the_pages_name_every_planner_command() -> None:
    kinds = {argv[0] if argv and not argv[0].startswith("-") else "" for argv in PLAN_COMMANDS}
    assert {"", "plan", "size", "ram", "profile"} <= kinds


@pytest.mark.parametrize("argv", PLAN_COMMANDS, ids=lambda argv: " ".join(argv)[:60] or "overview")
def test_documented_planner_command_runs(argv: list[str], monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.chdir(tmp_path)                                   # profile --out, plan --out write here
    monkeypatch.setenv("MEGATRAIN_HARDWARE", str(tmp_path / "no-profile.json"))  # this machine, detected
    # profile's benchmarks run in test_planner_cli; here its command line, checks and output file.
    monkeypatch.setattr(profiler, "measure", lambda spill_dir=None, log=None, compiled_layers=False: profiler.detect())
    rc = cli.main(argv)
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out.strip() and "issue #" not in out.out
    if argv[:1] == ["ram"]:
        assert "+NVMe" in out.out and "price assumed" in out.out
    if argv[:1] == ["profile"]:
        assert (tmp_path / argv[argv.index("--out") + 1]).exists()
