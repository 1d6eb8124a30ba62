"""A benchmark's results: the machine they were measured on, and the files they are written to.

``machine()`` is the one description of this machine every result file carries (the peer runners' probe adds its
device and matmul peak to it); ``write_report`` is the one way a run writes its JSON and Markdown, under a new name
each run (``new_base``), so no run overwrites another's; ``figure`` draws a plot beside them where matplotlib is
installed.
"""
from __future__ import annotations

import json
import os
import platform
import sys
from typing import Any, Callable


def new_base(base: str) -> str:
    """``base``, or ``base_2``, ``base_3``, ...: the first whose .json and .md do not exist, so no run overwrites
    another's results."""
    candidate, n = base, 1
    while os.path.exists(candidate + ".json") or os.path.exists(candidate + ".md"):
        n += 1
        candidate = f"{base}_{n}"
    return candidate


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's processor or architecture where that is unreadable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """This machine: platform, Python, torch, CPU model and cores, host RAM, and the GPU (with CUDA's version)
    where torch sees one."""
    import torch

    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__, "cpu": cpu_model(), "cores": os.cpu_count()}
    try:
        info["host_ram_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (AttributeError, OSError, ValueError):
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_mem_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def write_report(base: str, report: dict[str, Any], text: str | list[str], indent: int = 2) -> str:
    """``report`` as JSON and ``text`` (the Markdown, or its lines) under the first free name from ``base`` (its
    folder made if needed); the Markdown printed, and where both went. Returns the name without its ending (for a
    plot beside)."""
    os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
    stem = new_base(base)
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(report, f, indent=indent)
    if not isinstance(text, str):
        text = "\n".join(text) + "\n"
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    print(text, end="")
    print(f"wrote {stem}.json and .md", file=sys.stderr)
    return stem


def figure(path: str, size: tuple[float, float], draw: Callable[[Any], None], dpi: int = 100) -> str:
    """One plot of ``size`` inches, drawn by ``draw(ax)``, saved as ``path``; returns the path, or why there is none
    (matplotlib not installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped (matplotlib is not installed)"
    fig, ax = plt.subplots(figsize=size)
    draw(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
