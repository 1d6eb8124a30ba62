"""The import graph of ``megatrain.*``, read from the source with ``ast`` (nothing is imported).

DESIGN.md's layering, checked on every module of runtime/, planner/, plan/, tools/, models/ and megatrain/:

- no import cycle: every import counts, at module level, inside a function or under ``TYPE_CHECKING``
  (a cycle through a lazy import is still two modules that cannot be understood apart);
- the top-level packages are floors, lowest first: ``megatrain.errors``, ``models``, ``plan`` (the contract the
  planner writes and the runtime reads), ``planner``, ``runtime``, ``tools``; a module imports its own floor and the
  ones below, never one above;
- plan/ (the contract) stands on the standard library, ``megatrain.errors`` and the stdlib halves of models/;
- planner/ never imports the runtime, the tools, or torch (except ``planner/profiling/profiler.py`` and
  ``host_rates.py``, which measure the machine); the runtime never imports the tools, and reaches the planner's
  policy through one module only, its entry point ``RUNTIME_ENTRY_POINT`` (the default plan for a first batch);
- models/ (the model families) never imports the runtime, the planner or the tools; its stdlib halves (the
  registry, each family's config rules, parameter table and presets) import no torch and none of its torch
  halves (``models/layers/``, ``block_classes``, a family's ``blocks``); the planner imports only stdlib halves;
- no module reaches into another module's private names: ``from x import _name``, ``module._name`` on an
  imported module, or ``obj._name`` where ``_name`` is a private attribute only another file defines.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# folder -> import name (pyproject.toml's package-dir)
PACKAGES = {"megatrain": "megatrain", "runtime": "megatrain.runtime", "planner": "megatrain.planner",
            "plan": "megatrain.plan", "tools": "megatrain.tools", "models": "megatrain.models"}
# The top-level packages, lowest first (DESIGN.md section 1): each imports its own floor and those below.
TOP_FLOORS = ["megatrain", "megatrain.models", "megatrain.plan", "megatrain.planner", "megatrain.runtime",
              "megatrain.tools"]
# The planner modules allowed to import torch (inside the functions that measure a device).
PLANNER_TORCH_OK = {"megatrain.planner.profiling.profiler", "megatrain.planner.profiling.host_rates"}
# Private-looking names that are public API of the standard library (namedtuple's methods).
STDLIB_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}


@dataclass
class Module:
    name: str                      # megatrain.runtime.engine
    path: Path
    tree: ast.Module
    is_package: bool
    # module it imports -> the first line that does so
    imports: dict[str, int] = field(default_factory=dict)
    external: dict[str, int] = field(default_factory=dict)   # top-level names of other distributions (torch)

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]

    def where(self, line: int) -> str:
        return f"{self.path.relative_to(ROOT)}:{line}"


def _discover() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join((package, *(parts[:-1] if is_package else parts)))
            modules[name] = Module(name, path, ast.parse(path.read_text(), str(path)), is_package)
    return modules


def _absolute(mod: Module, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` names, relative levels resolved against ``mod``'s package."""
    if not node.level:
        return node.module or ""
    parts = mod.package.split(".")
    base = ".".join(parts[: len(parts) - node.level + 1])
    return f"{base}.{node.module}" if node.module else base


def _link(modules: dict[str, Module]) -> None:
    for mod in modules.values():
        for node in ast.walk(mod.tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(mod, node)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append(sub if sub in modules else source)
            for target in targets:
                if target.split(".")[0] != "megatrain":
                    mod.external.setdefault(target.split(".")[0], node.lineno)
                    continue
                # `import megatrain.runtime.x`: the deepest module of ours the dotted name reaches
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                if target in modules and target != mod.name:
                    mod.imports.setdefault(target, node.lineno)


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    found = _discover()
    _link(found)
    return found


def _knots(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in modules[v].imports:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for name in sorted(modules):
        if name not in index:
            visit(name)
    return components


def _cycles(modules: dict[str, Module]) -> list[list[str]]:
    """One shortest cycle through each knot."""
    return [_one_cycle(modules, set(c)) for c in _knots(modules)]


def _one_cycle(modules: dict[str, Module], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in modules[v].imports:
                if w == start:
                    return paths[v] + [start]
                if w in component and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def _describe(modules: dict[str, Module], cycle: list[str], members: set[str]) -> str:
    steps = [f"{a} ({modules[a].where(modules[a].imports[b])})" for a, b in zip(cycle, cycle[1:])]
    others = sorted(members - set(cycle))
    tail = f"; the same knot holds {', '.join(others)}" if others else ""
    return " -> ".join(steps + [cycle[-1]]) + tail


def test_the_graph_sees_every_module(modules: dict[str, Module]) -> None:
    # The reader itself must work: known edges are found, lazy and TYPE_CHECKING imports included.
    assert "megatrain.runtime.engine" in modules and "megatrain.plan.plan" in modules
    assert "megatrain.plan.plan" in modules["megatrain.runtime.engine"].imports
    assert "megatrain.errors" in modules["megatrain.plan.plan_checks"].imports
    assert "megatrain.runtime" in modules["megatrain.tools.train"].imports
    assert "torch" in modules["megatrain.planner.profiling.profiler"].external  # imported inside functions only
    assert "megatrain.models.registry" in modules["megatrain.plan.block_parameters"].imports
    assert "megatrain.models.qwen3.family" in modules["megatrain.models.registry"].imports
    assert _torch_half("megatrain.models.layers.decoder") and not _torch_half("megatrain.models.llama.family")
    assert len(modules) > 50


def test_the_cycle_finder_finds_cycles() -> None:
    def fake(name: str, *imports: str) -> Module:
        return Module(name, ROOT / "x.py", ast.parse(""), False, {i: 1 for i in imports})

    graph = {m.name: m for m in (fake("a", "b"), fake("b", "c"), fake("c", "a", "d"), fake("d"), fake("e", "d"))}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    del graph["c"].imports["a"]
    assert _cycles(graph) == []


def test_no_import_cycle(modules: dict[str, Module]) -> None:
    cycles = [_describe(modules, _one_cycle(modules, set(k)), set(k)) for k in _knots(modules)]
    assert not cycles, "import cycles in megatrain.*:\n" + "\n".join(cycles)


def _top(name: str) -> str:
    """The top-level package a module of ours belongs to (``megatrain`` for ``megatrain.errors``)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and ".".join(parts[:2]) in TOP_FLOORS else "megatrain"


def _top_floor_violations(modules: dict[str, Module]) -> list[str]:
    return [f"{mod.where(line)}: {_top(mod.name)} imports {target}" for mod in modules.values()
            for target, line in mod.imports.items()
            if TOP_FLOORS.index(_top(target)) > TOP_FLOORS.index(_top(mod.name))]


def test_top_level_packages_import_only_downwards(modules: dict[str, Module]) -> None:
    assert {_top(m) for m in modules} == set(TOP_FLOORS)
    bad = _top_floor_violations(modules)
    assert not bad, ("a package imports one above it (errors -> models -> plan -> planner -> runtime -> tools, "
                     "DESIGN.md section 1):\n" + "\n".join(bad))


def test_the_top_floor_check_finds_an_upward_import() -> None:
    def fake(name: str, *imports: str) -> Module:
        return Module(name, ROOT / "x.py", ast.parse(""), False, {i: 1 for i in imports})

    graph = {m.name: m for m in (
        fake("megatrain.plan.plan", "megatrain.planner.choice.search", "megatrain.errors"),
        fake("megatrain.models.registry", "megatrain.plan.buffer_kinds"),
        fake("megatrain.planner.choice.search", "megatrain.plan.plan", "megatrain.models.registry"),
        fake("megatrain.errors"), fake("megatrain.plan.buffer_kinds"))}
    found = sorted(line.split(": ", 1)[1] for line in _top_floor_violations(graph))
    assert found == ["megatrain.models imports megatrain.plan.buffer_kinds",
                     "megatrain.plan imports megatrain.planner.choice.search"]


def test_the_plan_contract_stands_on_the_stdlib(modules: dict[str, Module]) -> None:
    """What the planner writes and the runtime reads imports no torch, numpy or psutil, and of ours only the
    errors, itself and the stdlib halves of models/."""
    contract = [mod for mod in modules.values() if _top(mod.name) == "megatrain.plan"]
    assert {"megatrain.plan.plan", "megatrain.plan.buffer_kinds", "megatrain.plan.plan_checks",
            "megatrain.plan.workload_fingerprint"} <= {mod.name for mod in contract}
    bad = []
    for mod in contract:
        bad += [f"{mod.where(line)}: imports {name}" for name, line in mod.external.items()
                if name not in sys.stdlib_module_names]
        bad += [f"{mod.where(line)}: imports {target}" for target, line in mod.imports.items()
                if not (target == "megatrain.errors" or _top(target) == "megatrain.plan" or _stdlib_half(target))]
    assert not bad, "the plan contract imports beyond the stdlib, the errors and models' stdlib halves:\n" + \
        "\n".join(bad)


def test_planner_imports_neither_runtime_nor_tools_nor_torch(modules: dict[str, Module]) -> None:
    bad = []
    for mod in modules.values():
        if not mod.name.startswith("megatrain.planner"):
            continue
        for target, line in mod.imports.items():
            if target.startswith(("megatrain.runtime", "megatrain.tools")):
                bad.append(f"{mod.where(line)}: imports {target}")
        if "torch" in mod.external and mod.name not in PLANNER_TORCH_OK:
            bad.append(f"{mod.where(mod.external['torch'])}: imports torch")
    assert not bad, "the planner must stay free of the runtime, the tools and torch:\n" + "\n".join(bad)


# The planner's sub-folders, lowest first (planner/__init__.py): each imports only its own and those before it; the
# modules of the planner's top (the runtime's entry point, the Plan's former import path) import any of them, and
# none of them imports those.
PLANNER_GROUPS = ["shapes", "profiling", "costs", "choice", "commands"]


def _planner_group(name: str) -> int | None:
    """The floor of a planner module: its sub-folder's place in PLANNER_GROUPS (the top: past the last)."""
    if name != "megatrain.planner" and not name.startswith("megatrain.planner."):
        return None
    parts = name.split(".")
    return PLANNER_GROUPS.index(parts[2]) if len(parts) > 2 and parts[2] in PLANNER_GROUPS else len(PLANNER_GROUPS)


def _planner_group_violations(modules: dict[str, Module]) -> list[str]:
    bad = []
    for mod in modules.values():
        here = _planner_group(mod.name)
        if here is None:
            continue
        for target, line in mod.imports.items():
            there = _planner_group(target)
            if there is not None and there > here:
                bad.append(f"{mod.where(line)}: {mod.name} imports {target}")
    return bad


def test_planner_groups_import_only_downwards(modules: dict[str, Module]) -> None:
    assert {p.name for p in (ROOT / "planner").iterdir() if (p / "__init__.py").exists()} == set(PLANNER_GROUPS)
    bad = _planner_group_violations(modules)
    assert not bad, ("a planner sub-folder imports one after it (shapes -> profiling -> costs -> choice -> commands, "
                     "planner/__init__.py) or the planner's top:\n" + "\n".join(bad))


def test_the_planner_group_check_finds_an_upward_import() -> None:
    def fake(name: str, *imports: str) -> Module:
        return Module(name, ROOT / "x.py", ast.parse(""), False, {i: 1 for i in imports})

    graph = {m.name: m for m in (
        fake("megatrain.planner.shapes.model_shapes", "megatrain.planner.costs.memory_model", "megatrain.plan.plan"),
        fake("megatrain.planner.costs.memory_model", "megatrain.planner.shapes.model_shapes",
             "megatrain.planner.first_batch"),
        fake("megatrain.planner.first_batch", "megatrain.planner.costs.memory_model"))}
    found = sorted(line.split(": ", 1)[1] for line in _planner_group_violations(graph))
    assert found == ["megatrain.planner.costs.memory_model imports megatrain.planner.first_batch",
                     "megatrain.planner.shapes.model_shapes imports megatrain.planner.costs.memory_model"]


def _torch_half(name: str) -> bool:
    """A module of models/ that holds torch modules: the shared layers, the block classes, a family's blocks."""
    return name.startswith("megatrain.models") and (
        name.startswith("megatrain.models.layers") or name == "megatrain.models.block_classes"
        or name.endswith(".blocks"))


def _stdlib_half(name: str) -> bool:
    return name.startswith("megatrain.models") and not _torch_half(name)


def test_models_import_neither_runtime_nor_planner_nor_tools(modules: dict[str, Module]) -> None:
    bad = [f"{mod.where(line)}: imports {target}" for mod in modules.values()
           if mod.name.startswith("megatrain.models") for target, line in mod.imports.items()
           if target.startswith(("megatrain.runtime", "megatrain.planner", "megatrain.tools"))]
    assert not bad, "models/ stands on the standard library, torch and megatrain.errors alone:\n" + "\n".join(bad)


def test_stdlib_halves_of_models_import_no_torch(modules: dict[str, Module]) -> None:
    bad = []
    for mod in modules.values():
        if not _stdlib_half(mod.name):
            continue
        if "torch" in mod.external:
            bad.append(f"{mod.where(mod.external['torch'])}: imports torch")
        bad += [f"{mod.where(line)}: imports {target} (torch)" for target, line in mod.imports.items()
                if _torch_half(target)]
    assert len([m for m in modules if _stdlib_half(m)]) > 8 and not bad, \
        "the stdlib halves of models/ (what the planner reads) must stay free of torch:\n" + "\n".join(bad)


def test_planner_imports_only_stdlib_halves_of_models(modules: dict[str, Module]) -> None:
    bad = [f"{mod.where(line)}: imports {target}" for mod in modules.values()
           if mod.name.startswith("megatrain.planner") for target, line in mod.imports.items() if _torch_half(target)]
    assert not bad, "the planner reads the families' stdlib halves only:\n" + "\n".join(bad)


# The runtime's floors, lowest first (DESIGN.md section 1): a module may import its own floor and the floors
# below it, never one above. The base modules and the Engine's facade both sit in the runtime's top folder:
# the base at the bottom, the facade at the top. ``pipeline`` and ``io`` share a floor but never import each other.
RUNTIME_BASE = {"megatrain.runtime.errors", "megatrain.runtime.paths", "megatrain.runtime.config",
                "megatrain.runtime.config_ranges"}
RUNTIME_FLOORS = ["base", "device", "model", "spill", "state", "distributed", "optim", "pipeline|io", "facade"]


def _runtime_floor(name: str) -> tuple[int, str] | None:
    """(floor index, part) of a runtime module; None outside the runtime."""
    if not name.startswith("megatrain.runtime"):
        return None
    if name in RUNTIME_BASE:
        return 0, "base"
    rest = name.split(".")[2:]
    if len(rest) >= 2 or (rest and rest[0] in ("device", "model", "spill", "state", "distributed", "optim", "pipeline", "io")):
        part = rest[0]
        return next(i for i, f in enumerate(RUNTIME_FLOORS) if part in f.split("|")), part
    return len(RUNTIME_FLOORS) - 1, "facade"


def _floor_violations(modules: dict[str, Module]) -> list[str]:
    bad = []
    for mod in modules.values():
        here = _runtime_floor(mod.name)
        if here is None:
            continue
        for target, line in mod.imports.items():
            there = _runtime_floor(target)
            if there is None or target == "megatrain.runtime":
                continue
            if there[0] > here[0] or (there[0] == here[0] and there[1] != here[1]):
                bad.append(f"{mod.where(line)}: {here[1]} imports {target} ({there[1]})")
    return bad


def test_runtime_floors_import_only_downwards(modules: dict[str, Module]) -> None:
    bad = _floor_violations(modules)
    assert not bad, "a runtime subpackage imports one on its own floor or above (DESIGN.md section 1):\n" + \
        "\n".join(bad)


def test_the_floor_check_finds_an_upward_import() -> None:
    def fake(name: str, *imports: str) -> Module:
        return Module(name, ROOT / "x.py", ast.parse(""), False, {i: 1 for i in imports})

    graph = {m.name: m for m in (fake("megatrain.runtime.state.host_store", "megatrain.runtime.pipeline.executor"),
                                 fake("megatrain.runtime.pipeline.executor", "megatrain.runtime.io.hf_io",
                                      "megatrain.runtime.state.host_store", "megatrain.runtime.errors"),
                                 fake("megatrain.runtime.errors"), fake("megatrain.runtime.io.hf_io"))}
    found = sorted(line.split(": ", 1)[1] for line in _floor_violations(graph))
    assert found == ["pipeline imports megatrain.runtime.io.hf_io (io)",
                     "state imports megatrain.runtime.pipeline.executor (pipeline)"]
    assert {p for p in RUNTIME_FLOORS[1:-1] for p in p.split("|")} == {
        p.name for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").exists()}


# The pipeline's mixture-of-experts room (runtime/pipeline/experts/__init__.py): the executor alone drives it; the
# step's other pieces read only ``expert_parts`` (the ``Part`` a load carries), which imports nothing of the pipeline.
EXPERTS = "megatrain.runtime.pipeline.experts"
EXPERT_PARTS = f"{EXPERTS}.expert_parts"


def _in_experts(name: str) -> bool:
    return name == EXPERTS or name.startswith(f"{EXPERTS}.")


def _experts_violations(modules: dict[str, Module]) -> list[str]:
    bad = []
    for mod in modules.values():
        if not mod.name.startswith("megatrain.runtime.pipeline"):
            continue
        for target, line in mod.imports.items():
            if not target.startswith("megatrain.runtime.pipeline."):
                continue
            if (not _in_experts(mod.name) and _in_experts(target) and target != EXPERT_PARTS
                    and mod.name != "megatrain.runtime.pipeline.executor"):
                bad.append(f"{mod.where(line)}: {mod.name} imports {target} (only the executor drives the experts)")
            if mod.name == EXPERT_PARTS and not _in_experts(target):
                bad.append(f"{mod.where(line)}: expert_parts imports {target} (the step's pieces read its Part)")
    return bad


def test_only_the_executor_drives_the_experts(modules: dict[str, Module]) -> None:
    assert f"{EXPERTS}.expert_layers" in modules["megatrain.runtime.pipeline.executor"].imports
    assert EXPERT_PARTS in modules["megatrain.runtime.pipeline.step_schedule"].imports
    bad = _experts_violations(modules)
    assert not bad, "the pipeline and its experts (runtime/pipeline/experts/__init__.py):\n" + "\n".join(bad)


def test_the_experts_check_finds_a_step_piece_driving_them() -> None:
    def fake(name: str, *imports: str) -> Module:
        return Module(name, ROOT / "x.py", ast.parse(""), False, {i: 1 for i in imports})

    pipeline = "megatrain.runtime.pipeline"
    graph = {m.name: m for m in (
        fake(f"{pipeline}.executor", f"{EXPERTS}.expert_layers", EXPERT_PARTS),
        fake(f"{pipeline}.step_schedule", EXPERT_PARTS, f"{EXPERTS}.router_balance"),
        fake(EXPERT_PARTS, f"{pipeline}.grad_buffers", "megatrain.runtime.model.templates"),
        fake(f"{EXPERTS}.expert_layers", f"{pipeline}.grad_buffers", EXPERT_PARTS))}
    found = sorted(line.split(": ", 1)[1] for line in _experts_violations(graph))
    assert found == [
        f"expert_parts imports {pipeline}.grad_buffers (the step's pieces read its Part)",
        f"{pipeline}.step_schedule imports {EXPERTS}.router_balance (only the executor drives the experts)"]


def test_runtime_does_not_import_tools(modules: dict[str, Module]) -> None:
    bad = [f"{mod.where(line)}: imports {target}" for mod in modules.values()
           if mod.name.startswith("megatrain.runtime") for target, line in mod.imports.items()
           if target.startswith("megatrain.tools")]
    assert not bad, "\n".join(bad)


# The runtime reaches the planner's policy through this module alone (DESIGN.md section 1): the default plan for a
# first batch (its kept layers) and what a batch's activations need (to refuse one that cannot fit). The contract
# the runtime reads is megatrain.plan, below the planner.
RUNTIME_ENTRY_POINT = "megatrain.planner.first_batch"


def _runtime_planner_edges(modules: dict[str, Module]) -> dict[tuple[str, str], str]:
    """Each import of a planner module by a runtime module, with where it is."""
    return {(mod.name, target): mod.where(line)
            for mod in modules.values() if mod.name.startswith("megatrain.runtime")
            for target, line in mod.imports.items() if target.startswith("megatrain.planner")}


def _beyond_the_entry_point(modules: dict[str, Module]) -> list[str]:
    return sorted(f"{where}: {a} imports {b}" for (a, b), where in _runtime_planner_edges(modules).items()
                  if b != RUNTIME_ENTRY_POINT)


def test_runtime_reaches_the_planner_only_through_its_entry_point(modules: dict[str, Module]) -> None:
    bad = _beyond_the_entry_point(modules)
    assert not bad, (f"the runtime imports the planner beyond its entry point {RUNTIME_ENTRY_POINT} (DESIGN.md "
                     "section 1): import the contract (megatrain.plan) or ask the entry point:\n" + "\n".join(bad))
    assert {b for a, b in _runtime_planner_edges(modules)} == {RUNTIME_ENTRY_POINT}  # the entry point is there


def test_the_entry_point_check_sees_a_new_runtime_import_of_the_planner() -> None:
    graph = {m.name: m for m in (
        Module("megatrain.runtime.pipeline.executor", ROOT / "x.py", ast.parse(""), False,
               {"megatrain.plan.plan": 1, "megatrain.planner.choice.search": 2, RUNTIME_ENTRY_POINT: 3,
                "megatrain.runtime.errors": 4}),
        Module("megatrain.runtime.errors", ROOT / "y.py", ast.parse(""), False))}
    assert [line.split(": ", 1)[1] for line in _beyond_the_entry_point(graph)] == [
        "megatrain.runtime.pipeline.executor imports megatrain.planner.choice.search"]


def test_the_documented_plan_path_still_imports() -> None:
    """docs/how-it-works.md names the Plan's module by its former path: it still gives the same class."""
    from megatrain.plan.plan import Plan
    from megatrain.plan.plan import Plan as FormerPath
    assert FormerPath is Plan


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_aliases(mod: Module, modules: dict[str, Module]) -> dict[str, str]:
    """Local names bound to one of our modules: ``from . import x``, ``import megatrain.runtime.x as x``."""
    aliases: dict[str, str] = {}
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(mod, node)
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
    return aliases


def test_no_private_names_from_other_modules(modules: dict[str, Module]) -> None:
    bad = _private_module_names(modules)
    assert not bad, "private names of another module:\n" + "\n".join(bad)


def _private_module_names(modules: dict[str, Module]) -> list[str]:
    """``from x import _name`` and ``x._name`` where x is another of our modules."""
    bad = []
    for mod in modules.values():
        aliases = _module_aliases(mod, modules)
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(mod, node)
                if source.split(".")[0] != "megatrain":
                    continue
                for alias in node.names:
                    if _private(alias.name) and f"{source}.{alias.name}" not in modules:
                        bad.append(f"{mod.where(node.lineno)}: from {source} import {alias.name}")
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                dotted = _dotted(node.value)
                target = aliases.get(dotted, dotted) if dotted else None
                if target in modules and target != mod.name:
                    bad.append(f"{mod.where(node.lineno)}: {dotted}.{node.attr} ({target})")
    return bad


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _foreign_names(mod: Module) -> set[str]:
    """Local names bound to modules of other distributions (``torch``, ``np``)."""
    names: set[str] = set()
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                      if alias.name.split(".")[0] != "megatrain"}
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] != "megatrain":
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def _defined_privates(mod: Module) -> set[str]:
    """Private attribute names this file owns: its functions, methods and classes, names assigned at module
    or class level, and ``self._x`` / ``cls._x`` assignments."""
    names: set[str] = set()
    for node in ast.walk(mod.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Name):
                        names.add(sub.id)
                    elif (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                          and sub.value.id in ("self", "cls")):
                        names.add(sub.attr)
    return {n for n in names if _private(n)}


def test_no_private_attributes_of_other_modules_objects(modules: dict[str, Module]) -> None:
    bad = _private_attributes(modules)
    assert not bad, "private attributes of objects other modules own:\n" + "\n".join(bad)


def _private_attributes(modules: dict[str, Module]) -> list[str]:
    """``obj._name`` (read, written or called) where ``_name`` is private to another file: reaching into
    an object another module owns. ``self._x`` / ``cls._x`` are the class's own business."""
    owned = {name: _defined_privates(mod) for name, mod in modules.items()}
    bad = []
    for mod in modules.values():
        foreign = _foreign_names(mod)
        for node in ast.walk(mod.tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)) or node.attr in STDLIB_UNDERSCORE:
                continue
            root = _root_name(node)
            if root in ("self", "cls") and isinstance(node.value, ast.Name):
                continue
            if root in foreign:  # torch._C._profiler: another distribution's business
                continue
            if node.attr in owned[mod.name]:
                continue
            owners = sorted(other for other, names in owned.items() if node.attr in names)
            if owners:
                bad.append(f"{mod.where(node.lineno)}: {ast.unparse(node)} (private to {', '.join(owners)})")
    return bad


def test_the_private_checks_find_reaching_in() -> None:
    sources = {
        "megatrain.runtime.store": "import torch\nclass Store:\n    def __init__(self):\n        self._arena = 1\n"
                                   "    def _grow(self):\n        return self._arena + torch._C._x\n_LIMIT = 3\n",
        "megatrain.runtime.user": "from . import store\nfrom .store import _LIMIT\n"
                                  "import megatrain.runtime.store as st\n"
                                  "def f(s):\n    return s._arena, s.owner._grow(), store._LIMIT, st._LIMIT, s._own\n"
                                  "class Own:\n    _own = 0\n",
    }
    fake = {name: Module(name, ROOT / "runtime" / f"{name.rpartition('.')[2]}.py", ast.parse(src), False)
            for name, src in sources.items()}
    _link(fake)
    assert fake["megatrain.runtime.user"].imports == {"megatrain.runtime.store": 1}
    found = sorted(line.split(": ", 1)[1] for line in _private_module_names(fake))
    assert found == ["from megatrain.runtime.store import _LIMIT", "st._LIMIT (megatrain.runtime.store)",
                     "store._LIMIT (megatrain.runtime.store)"]
    found = sorted(line.split(": ", 1)[1] for line in _private_attributes(fake))
    owner = "(private to megatrain.runtime.store)"
    assert found == [f"s._arena {owner}", f"s.owner._grow {owner}", f"st._LIMIT {owner}", f"store._LIMIT {owner}"]
