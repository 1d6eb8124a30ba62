"""Ctrl-C during training: the first one asks the loop to stop cleanly, a second one exits at once.

The loop polls ``requested`` between steps; it then saves a checkpoint and exits with status 130
(128 + SIGINT, what a shell reports for an interrupted command). A second Ctrl-C (while the
checkpoint is being written, say) exits immediately with status 130, without cleanup: checkpoints
are committed atomically, so the previous one stays valid.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType
from typing import Iterator

EXIT_INTERRUPTED = 130
INTERRUPTED_AT_START = "\nmegatrain-train: interrupted before training started\n"


@contextlib.contextmanager
def start_up(command: bool) -> Iterator[None]:
    """Ctrl-C while the command loads its modules (torch takes seconds): one line and status 130, no traceback.

    Only when running as the command (``command``); a program that imports the module gets its KeyboardInterrupt.
    While the modules load, Ctrl-C is only noted and acted on once they are loaded: a KeyboardInterrupt raised
    inside a Python callback of torch's C++ start-up code cannot unwind through it and aborts the process.
    """
    if not command or threading.current_thread() is not threading.main_thread():
        yield
        return
    asked: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: asked.append(signum))
    try:
        yield
    except KeyboardInterrupt:
        asked.append(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)
    if asked:
        sys.stderr.write(INTERRUPTED_AT_START)
        sys.exit(EXIT_INTERRUPTED)


class InterruptGuard:
    """Context manager that owns SIGINT while the training loop runs (main thread only)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: object = None
        self._installed = False

    def __enter__(self) -> "InterruptGuard":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]
            self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            os.write(2, b"\nmegatrain-train: second Ctrl-C, exiting now without saving\n")
            os._exit(EXIT_INTERRUPTED)
        self.requested = True
        os.write(2, b"\nmegatrain-train: Ctrl-C, saving a checkpoint after this step "
                    b"(press Ctrl-C again to exit at once)\n")
