"""README.md and docs/: short enough to read, every link lands, every megatrain-train and megatrain-export command
line is one the command accepts, and CI runs the test command the README gives."""
from __future__ import annotations

import pathlib
import re

import pytest

from doc_pages import README, ROOT, code_blocks, commands, pages
from megatrain.tools import export, train_options

def case_id(value) -> str:
    return value.name if isinstance(value, pathlib.Path) else " ".join(value)[:50]


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.*)$", page.read_text(), flags=re.M)}


def test_readme_is_read_in_ten_minutes():
    assert len(README.read_text().splitlines()) <= 300


def test_the_readme_links_every_docs_page():
    linked = set(LINK.findall(README.read_text()))
    assert {f"docs/{p.name}" for p in pages()[1:]} <= linked


@pytest.mark.parametrize("page", pages(), ids=case_id)
def test_every_relative_link_lands_on_a_file_and_heading(page):
    missing = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue                                  # https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            missing.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            missing.append(target)
    assert not missing, f"{page.name}: links to nothing: {missing}"


@pytest.mark.parametrize("page", pages(), ids=case_id)
def test_pages_name_no_issue_numbers(page):
    assert not re.search(r"issue #?\d+|#\d{2,}\b", page.read_text(), flags=re.I)


TRAIN_COMMANDS = commands("megatrain-train")


def test_the_pages_hold_training_commands():
    assert len(TRAIN_COMMANDS) >= 10 and {p.name for p, _ in TRAIN_COMMANDS} >= {"training.md", "chat.md"}


@pytest.mark.parametrize("page,argv", TRAIN_COMMANDS, ids=case_id)
def test_documented_training_command_parses(page, argv):
    train_options.build_parser().parse_args(argv)     # an unknown or misspelt option raises TrainConfigError


@pytest.mark.parametrize("page,argv", commands("megatrain-export"), ids=case_id)
def test_documented_export_command_parses(page, argv):
    export.build_parser().parse_args(argv)


def test_ci_runs_the_readme_test_command():
    readme_lines = [line for page, code in code_blocks("bash") if page == README for line in code.splitlines()
                    if "pytest" in line]
    assert len(readme_lines) == 1, readme_lines
    ci_line = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line and
               not line.startswith("#")]
    assert len(ci_line) == 1
    assert ci_line[0].replace("pip install -q ", "pip install ") == readme_lines[0]
