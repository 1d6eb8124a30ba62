"""The disk's busy time, and a wake-up when a transfer lands (the read-ahead's signal that the disk may be idle)."""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Callable


class BusyClock:
    """Seconds during which at least one transfer of a kind was in flight (the union of their intervals),
    cumulative: the disk's busy time, read as a difference over a step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight = 0
        self._since = 0.0
        self._total = 0.0
        self._wake: Callable[[], None] | None = None  # see ``when_done``

    def track(self, future: cf.Future) -> cf.Future:
        with self._lock:
            if self._inflight == 0:
                self._since = time.perf_counter()
            self._inflight += 1
        future.add_done_callback(self._done)
        return future

    def _done(self, _: cf.Future) -> None:
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0:
                self._total += time.perf_counter() - self._since
            wake, self._wake = self._wake, None
        if wake is not None:
            wake()

    @property
    def inflight(self) -> int:
        return self._inflight

    def when_done(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` once, from the thread that finishes it, when the next transfer lands."""
        with self._lock:
            self._wake = wake

    @property
    def seconds(self) -> float:
        with self._lock:
            return self._total + (time.perf_counter() - self._since if self._inflight else 0.0)
