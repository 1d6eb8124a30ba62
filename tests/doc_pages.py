"""The user-facing pages (README.md and docs/*.md) and the code in them, for the tests that run it."""
from __future__ import annotations

import pathlib
import re
import shlex

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def pages() -> list[pathlib.Path]:
    """README.md, then every docs/*.md page in name order."""
    return [README] + sorted((ROOT / "docs").glob("*.md"))


def code_blocks(language: str) -> list[tuple[pathlib.Path, str]]:
    """Every fenced block of ``language`` (```python, ```bash) on every page, with its page."""
    fence = re.compile(r"^```" + re.escape(language) + r"\n(.*?)^```", flags=re.S | re.M)
    return [(page, code) for page in pages() for code in fence.findall(page.read_text())]


def shell_lines(code: str) -> list[str]:
    """A bash block's command lines, continuation lines (ending in a backslash) joined to their command."""
    lines, pending = [], ""
    for line in code.splitlines():
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    return [line for line in lines if line.strip()]


def commands(program: str) -> list[tuple[pathlib.Path, list[str]]]:
    """The arguments of every call of ``program`` in the pages' bash blocks (directly, after ``&&``, or as
    ``$(which program)`` under torchrun), comments dropped; each distinct command line once."""
    found, seen = [], set()
    for page, code in code_blocks("bash"):
        for line in shell_lines(code):
            if program not in line:
                continue
            words = shlex.split(line.replace(f"$(which {program})", program), comments=True)
            for start, word in enumerate(words):
                if word != program:
                    continue
                argv = words[start + 1:]
                argv = argv[:argv.index("&&")] if "&&" in argv else argv
                if (key := tuple(argv)) not in seen:
                    seen.add(key)
                    found.append((page, argv))
    return found
