"""Where a benchmark writes its results: a new name each run, so no run overwrites another's."""
from __future__ import annotations

import os


def new_base(base: str) -> str:
    """``base``, or ``base_2``, ``base_3``, ...: the first whose .json and .md do not exist, so no run overwrites
    another's results."""
    candidate, n = base, 1
    while os.path.exists(candidate + ".json") or os.path.exists(candidate + ".md"):
        n += 1
        candidate = f"{base}_{n}"
    return candidate
