"""Every megatrain-plan command in README.md runs as written (exit 0)."""
from __future__ import annotations

import pathlib
import re
import shlex

import pytest

from megatrain.planner import cli, profiler

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def readme_commands() -> list[list[str]]:
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for line in block.splitlines():
            if line.split()[:1] == ["megatrain-plan"]:
                commands.append(shlex.split(line, comments=True)[1:])
    return commands


def test_readme_names_planner_commands() -> None:
    kinds = {argv[0] if argv and not argv[0].startswith("-") else "" for argv in readme_commands()}
    assert {"", "plan", "size", "ram", "profile"} <= kinds


@pytest.mark.parametrize("argv", readme_commands(), ids=lambda argv: " ".join(argv)[:60] or "overview")
def test_readme_planner_command_runs(argv: list[str], monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.chdir(tmp_path)                                   # profile --out, plan --out write here
    monkeypatch.setenv("MEGATRAIN_HARDWARE", str(tmp_path / "no-profile.json"))  # this machine, detected
    # profile's benchmarks run in test_planner_cli; here its command line, checks and output file.
    monkeypatch.setattr(profiler, "measure", lambda spill_dir=None, log=None: profiler.detect())
    rc = cli.main(argv)
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out.strip() and "issue #" not in out.out
    if argv[:1] == ["ram"]:
        assert "+NVMe" in out.out and "price assumed" in out.out
    if argv[:1] == ["profile"]:
        assert (tmp_path / argv[argv.index("--out") + 1]).exists()
