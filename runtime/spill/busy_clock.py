"""The disk's busy time, and the next transfer's landing (what the read-ahead's caller waits for: the disk may be
idle then)."""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time


class BusyClock:
    """Seconds during which at least one transfer of a kind was in flight (the union of their intervals),
    cumulative: the disk's busy time, read as a difference over a step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight = 0
        self._since = 0.0
        self._total = 0.0
        self._landing: cf.Future | None = None  # see ``next_landing``

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
            landing, self._landing = self._landing, None
        if landing is not None:
            landing.set_result(None)

    @property
    def inflight(self) -> int:
        return self._inflight

    def next_landing(self) -> cf.Future:
        """A future done when the next transfer lands (the same one for every caller until then): a thread that
        waits for the disk waits on it, nothing is called back."""
        with self._lock:
            if self._landing is None:
                self._landing = cf.Future()
            return self._landing

    @property
    def seconds(self) -> float:
        with self._lock:
            return self._total + (time.perf_counter() - self._since if self._inflight else 0.0)
