"""Write benchmarks/results/README.md: every results file, grouped by benchmark and device, newest first.

    python benchmarks/results_index.py            # rewrite the index
    python benchmarks/results_index.py --check    # exit 1 if the index is not what the files present give

A run's files share a base name, ``<date>_<device>_<benchmark>[_<label>]`` followed by ``.json``, ``.md``,
``.png`` or ``.log``; the benchmark is the longest script name in ``benchmarks/`` the rest starts with
(``own_loop_cli`` before ``own_loop``), a hardware profile is ``hardware``, and a GPU session's log is named
after the part of ``gpu_session.sh`` it ran. A run's title is its Markdown table's first heading.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
INDEX = "README.md"
NAME = re.compile(r"(?P<date>\d{4}-\d{2}-\d{2})_(?P<device>[^_]+)_(?P<rest>.+)")
KINDS = (".json", ".md", ".png", ".log")
# Results named after something other than a benchmark script.
OTHER = {"hardware": "hardware profile (megatrain-plan profile)", "first": "gpu_session", "offload": "gpu_session"}


def benchmark_names() -> list[str]:
    """The benchmark scripts' names, longest first, so a name is matched before any prefix of it."""
    names = [p.stem for p in HERE.glob("*.py") if p.stem not in ("results_index", "result_files")]
    return sorted(names + ["gpu_session"], key=len, reverse=True)


def classify(base: str, names: list[str]) -> tuple[str, str, str, str]:
    """(benchmark, device, date, label) of a run's base name; the device without its vendor prefix."""
    m = NAME.fullmatch(base)
    if not m:
        return "other", "-", "-", base
    rest = m["rest"]
    device = m["device"].removeprefix("NVIDIA-")
    for name in names:
        if rest == name or rest.startswith(name + "_"):
            return name, device, m["date"], rest[len(name) + 1:]
    for key, name in OTHER.items():
        if rest == key or rest.startswith(key + "_"):
            return name, device, m["date"], rest[len(key) + 1:]
    return "other", device, m["date"], rest


def title(md: pathlib.Path) -> str:
    for line in md.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return ""


def runs(directory: pathlib.Path = RESULTS) -> dict[str, list[str]]:
    """Each run's base name with its files' suffixes, in suffix order."""
    found: dict[str, list[str]] = {}
    for path in directory.iterdir():
        if path.name == INDEX or path.suffix not in KINDS:
            continue
        found.setdefault(path.name[: -len(path.suffix)], []).append(path.suffix)
    return {base: sorted(suffixes, key=KINDS.index) for base, suffixes in found.items()}


def render(directory: pathlib.Path = RESULTS) -> str:
    """The index's Markdown for the files in ``directory``."""
    names = benchmark_names()
    groups: dict[tuple[str, str], list[tuple[str, str, str, str]]] = {}
    for base, suffixes in runs(directory).items():
        benchmark, device, date, label = classify(base, names)
        files = ", ".join(f"[{s[1:]}]({base}{s})" for s in suffixes)
        heading = title(directory / (base + ".md")) if ".md" in suffixes else ""
        first = base + (".md" if ".md" in suffixes else suffixes[0])
        groups.setdefault((benchmark, device), []).append(
            (date, base, first, f"| {date} | {label or '-'} | {heading} | {files} |"))
    out = ["# Benchmark results", "",
           "Every file the benchmarks wrote here, by benchmark and device, newest first (the runs of one day in",
           "reverse name order). Written by",
           "`python benchmarks/results_index.py` from the files present; how the benchmarks measure is in",
           "[benchmarks/README.md](../README.md), and what the figures mean for a user in",
           "[docs/benchmarks.md](../../docs/benchmarks.md).", "",
           "## Newest run of each benchmark on each device", "",
           "| benchmark | device | date | newest run | runs |", "|---|---|---|---|---|"]
    ordered = sorted(groups)
    for key in ordered:
        rows = sorted(groups[key], reverse=True)
        date, base, first, _ = rows[0]
        out.append(f"| [{key[0]}](#{anchor(key)}) | {key[1]} | {date} | [{base}]({first}) | {len(rows)} |")
    for key in ordered:
        out += ["", f"## {key[0]}, {key[1]}", "", "| date | label | title | files |", "|---|---|---|---|"]
        out += [row for *_, row in sorted(groups[key], reverse=True)]
    return "\n".join(out) + "\n"


def anchor(key: tuple[str, str]) -> str:
    """GitHub's anchor for the section heading ``## <benchmark>, <device>``."""
    return re.sub(r"[^\w\- ]", "", f"{key[0]}, {key[1]}".lower()).replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the index is out of date; write nothing")
    args = parser.parse_args(argv)
    text, path = render(), RESULTS / INDEX
    if args.check:
        if not path.exists() or path.read_text() != text:
            print(f"{path} is out of date: run python benchmarks/results_index.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
