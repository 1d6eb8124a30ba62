"""The AdamW worker's job queue: jobs in the order they come, and the worker's one wait, for its next job or for
what the read-ahead waits for (the disk's next landing), whichever comes first.

The wait is the worker's own (``wait(landing)``): the disk hands it a future, the step puts jobs, and nothing is
called back into the worker from another thread ([Note: spill read-ahead] in runtime/spill/read_ahead.py).
Bound: what is put, the worker's jobs (one per block of a step, [Note: optimizer modes]) and the closing None.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import threading
from typing import Generic, TypeVar

T = TypeVar("T")
EMPTY = object()  # what ``take`` and ``wait`` return when no job is queued


class JobQueue(Generic[T]):
    """Jobs from any thread to the one thread that takes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: collections.deque[T] = collections.deque()
        self._arrived: cf.Future = cf.Future()  # done once a job is put after the last look at an empty queue

    def put(self, item: T) -> None:
        with self._lock:
            self._items.append(item)
            arrived, self._arrived = self._arrived, cf.Future()
        if not arrived.done():
            arrived.set_result(None)

    def take(self) -> T | object:
        """The oldest job, or ``EMPTY`` at once."""
        with self._lock:
            return self._items.popleft() if self._items else EMPTY

    def wait(self, landing: cf.Future | None) -> T | object:
        """The oldest job, waiting for one; ``EMPTY`` once ``landing`` is done with none queued (None: wait for a
        job only)."""
        with self._lock:
            if self._items:
                return self._items.popleft()
            arrived = self._arrived
        cf.wait([arrived] if landing is None else [arrived, landing], return_when=cf.FIRST_COMPLETED)
        return self.take()
