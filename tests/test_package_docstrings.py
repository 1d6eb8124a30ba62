"""Every package of the product says what it holds: its ``__init__.py`` docstring lists exactly its modules and says
what it may import.

The packages are megatrain/ and every folder with an ``__init__.py`` under runtime/, planner/, plan/, tools/ and
models/ (pyproject.toml's package-dir). A docstring has a paragraph starting ``Modules:`` naming each module as
``name.py`` and each sub-package as ``name/`` (in double backticks; anything else in backticks there is prose), and
one starting ``May import:``. A module added without being listed, or one listed that is not there, fails the test;
``tests/test_import_graph.py`` checks what the packages import.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"megatrain": "megatrain", "models": "megatrain.models", "plan": "megatrain.plan",
           "planner": "megatrain.planner", "runtime": "megatrain.runtime", "tools": "megatrain.tools"}
ENTRY = re.compile(r"``([A-Za-z_][A-Za-z0-9_]*)(\.py|/)``")


def _paragraph(doc: str, label: str) -> str | None:
    """The paragraph of ``doc`` that starts with ``label`` (up to the next blank line), without the label."""
    for block in re.split(r"\n\s*\n", doc):
        if block.strip().startswith(label):
            return block.strip()[len(label):]
    return None


def listed(doc: str) -> set[str] | None:
    """The entries the ``Modules:`` paragraph names (``name.py``, ``name/``); None without that paragraph."""
    text = _paragraph(doc, "Modules:")
    return None if text is None else {name + kind for name, kind in ENTRY.findall(text)}


def present(folder: Path, children: tuple[str, ...] = ()) -> set[str]:
    """What a package folder holds: its modules (``name.py``) and sub-packages (``name/``), plus ``children``:
    the packages pyproject.toml maps beneath it from other folders (megatrain's)."""
    found = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
    found |= {p.name + "/" for p in folder.iterdir() if (p / "__init__.py").exists()}
    return found | {c + "/" for c in children}


def problems(name: str, doc: str | None, holds: set[str]) -> list[str]:
    """What is wrong with a package's docstring against what the package ``holds``."""
    if not doc:
        return [f"{name}: no docstring"]
    out = []
    entries = listed(doc)
    if entries is None:
        out.append(f"{name}: no 'Modules:' paragraph listing its modules")
    else:
        if holds - entries:
            out.append(f"{name}: 'Modules:' leaves out {', '.join(sorted(holds - entries))}")
        if entries - holds:
            out.append(f"{name}: 'Modules:' names {', '.join(sorted(entries - holds))}, which it does not hold")
    if not (_paragraph(doc, "May import:") or "").strip():
        out.append(f"{name}: no 'May import:' paragraph")
    return out


def _packages() -> dict[str, tuple[Path, tuple[str, ...]]]:
    """Package name -> (its folder, the packages mapped beneath it from other folders)."""
    found = {}
    for folder, package in FOLDERS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            parts = init.parent.relative_to(ROOT / folder).parts
            found[".".join((package, *parts))] = (init.parent, ())
    top = tuple(p.rpartition(".")[2] for p in FOLDERS.values() if p != "megatrain")
    found["megatrain"] = (ROOT / "megatrain", top)
    return found


def test_every_package_lists_its_modules_and_what_it_may_import() -> None:
    packages = _packages()
    assert {"megatrain.planner.costs", "megatrain.runtime.pipeline", "megatrain.models.layers"} <= set(packages)
    bad = []
    for name, (folder, children) in sorted(packages.items()):
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
        bad += problems(name, doc, present(folder, children))
    assert not bad, "package docstrings out of step with their folders:\n" + "\n".join(bad)


def test_the_check_finds_a_module_left_out_or_one_not_there() -> None:
    holds = {"plan.py", "plan_checks.py", "commands/"}
    good = "What it is.\n\nModules: ``plan.py`` (the ``Plan``), ``plan_checks.py``, ``commands/``.\n\nMay import: x."
    assert problems("p", good, holds) == []
    assert problems("p", good, holds | {"new.py"}) == ["p: 'Modules:' leaves out new.py"]
    assert problems("p", good, holds - {"commands/"}) == ["p: 'Modules:' names commands/, which it does not hold"]
    assert problems("p", good.replace("May import: x.", ""), holds) == ["p: no 'May import:' paragraph"]
    assert problems("p", "What it is.", holds) == ["p: no 'Modules:' paragraph listing its modules",
                                                   "p: no 'May import:' paragraph"]
    assert problems("p", None, holds) == ["p: no docstring"]
