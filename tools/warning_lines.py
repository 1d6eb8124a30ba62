"""Warnings said as one line each: ``megatrain-train: warning: <message>``, never Python's default form, which
adds the category and echoes the source line that raised it (a failed checkpoint write, a skipped non-finite
update, a left-over spill directory: each is one line a person reads, in the place the progress display allows).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def one_line_warnings(say: Callable[[str], None]) -> Iterator[None]:
    """Within the block, each warning shown (after Python's filters: a repeated one once) goes to ``say`` as
    one line; the previous way of showing warnings comes back after it."""
    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        text = str(message).strip()
        say(f"megatrain-train: warning: {text.splitlines()[0] if text else category.__name__}")

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield
