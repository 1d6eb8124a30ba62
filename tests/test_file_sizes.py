"""No file of runtime/, planner/, tools/ or models/ grows past 600 lines (style.md: past that, split it by
responsibility; DESIGN.md names the file that owns each stage)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 600


def test_no_file_over_600_lines() -> None:
    files = [p for folder in ("runtime", "planner", "tools", "models") for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(files) > 30  # the folders were found
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in files}
    over = [f"{name}: {n} lines" for name, n in sizes.items() if n > MAX_LINES]
    assert not over, f"over {MAX_LINES} lines (split by responsibility):\n" + "\n".join(over)
