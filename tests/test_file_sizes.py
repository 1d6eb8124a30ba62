"""Size as guidance, not a squeeze (style.md: past a size, split by responsibility; DESIGN.md names the file that
owns each stage). Files of runtime/, planner/, plan/, tools/, models/ and benchmarks/ past 400 lines, and classes
past 250, are named in a warning in the test's output: the place to look for a second responsibility. Past 500
lines, or 350 for a class, the test fails. A docstring is never trimmed to stay under either: it says what the code cannot.
"""
from __future__ import annotations

import ast
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("runtime", "planner", "plan", "tools", "models", "benchmarks")
SOFT_LINES, HARD_LINES = 400, 500
SOFT_CLASS_LINES, HARD_CLASS_LINES = 250, 350
ENGINE_LINES = 250  # the Engine is a thin facade over its collaborators, held to the soft class limit


class SizeWarning(UserWarning):
    """A file or class past the soft limit: where to look for a second responsibility."""


def _sources() -> dict[str, str]:
    files = [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 30  # the folders were found
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in files}


def _class_sizes(sources: dict[str, str]) -> dict[str, int]:
    """``file::Class`` -> its lines, from ``class`` to its last line (nested classes counted on their own too)."""
    sizes = {}
    for name, text in sources.items():
        for node in ast.walk(ast.parse(text, name)):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                sizes[f"{name}::{node.name}"] = node.end_lineno - node.lineno + 1
    return sizes


def _over(sizes: dict[str, int], soft: int, hard: int, what: str) -> None:
    large = sorted(f"{name}: {n} lines" for name, n in sizes.items() if soft < n <= hard)
    if large:
        warnings.warn(SizeWarning(f"{what} over {soft} lines (look for a second responsibility): " + "; ".join(large)))
    over = sorted(f"{name}: {n} lines" for name, n in sizes.items() if n > hard)
    assert not over, f"{what} over {hard} lines (split by responsibility):\n" + "\n".join(over)


def test_no_file_over_the_hard_limit() -> None:
    _over({name: len(text.splitlines()) for name, text in _sources().items()}, SOFT_LINES, HARD_LINES, "files")


def test_no_class_over_the_hard_limit() -> None:
    sizes = _class_sizes(_sources())
    assert 0 < sizes["runtime/engine.py::Engine"] <= ENGINE_LINES, "the Engine is a thin facade: keep it so"
    _over(sizes, SOFT_CLASS_LINES, HARD_CLASS_LINES, "classes")


def test_the_limits_catch_what_they_say() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _over({"a.py": SOFT_LINES + 1, "b.py": SOFT_LINES}, SOFT_LINES, HARD_LINES, "files")
    assert [str(w.message) for w in seen] == [f"files over {SOFT_LINES} lines (look for a second responsibility): "
                                              f"a.py: {SOFT_LINES + 1} lines"]
    try:
        _over({"c.py": HARD_LINES + 1}, SOFT_LINES, HARD_LINES, "files")
    except AssertionError as e:
        assert "c.py: 501 lines" in str(e)
    else:
        raise AssertionError("a file past the hard limit passed")
