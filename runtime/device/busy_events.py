"""The busy time of the work a timed step issues on a side stream (the device AdamW's updates on the ``optim``
stream): a pair of timing events around each piece on CUDA, read once the step is asked for; on a CPU device the
work runs on the calling thread, and its host seconds are its busy time.

Only a step the step timer arms records anything ([Note: opt-in timing] in runtime/pipeline/step_timer.py): the
timer turns it on at the step's begin and off at its end; every other step pays one attribute check per piece.
Nothing here syncs during the step: ``seconds()`` waits for the last piece's end event when it is read.
Bound: two events per piece of one step (the device AdamW: one piece per resident block).
"""
from __future__ import annotations

import contextlib
import time
from typing import ContextManager, Iterator

import torch

from megatrain.runtime.device.streams import Stream

_UNTIMED: ContextManager[None] = contextlib.nullcontext()


class BusyEvents:
    """One side stream's busy seconds in the timed step."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.active = False  # the step being issued is timed
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._host = 0.0  # a CPU device: host seconds of the pieces

    def start(self) -> None:
        """A timed step begins: what it issues is timed from now, the last step's figures dropped."""
        self.active, self._pairs, self._host = True, [], 0.0

    def stop(self) -> None:
        """The timed step is issued: nothing more is timed."""
        self.active = False

    def around(self, stream: Stream) -> ContextManager[None]:
        """Time the work issued inside on ``stream`` (enter after the waits that order it, so only it counts)."""
        if not self.active:
            return _UNTIMED
        return self._events(stream) if self.cuda else self._host_seconds()

    @contextlib.contextmanager
    def _events(self, stream: Stream) -> Iterator[None]:
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream.raw)
        try:
            yield
        finally:
            after.record(stream.raw)
            self._pairs.append((before, after))

    @contextlib.contextmanager
    def _host_seconds(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._host += time.perf_counter() - t0

    def seconds(self) -> float:
        """The pieces' busy seconds (CUDA: waits for the last piece's end, once, when read after the step)."""
        if not self.cuda:
            return self._host
        if self._pairs:
            self._pairs[-1][1].synchronize()  # the pieces run in order on one stream
        return sum(before.elapsed_time(after) for before, after in self._pairs) / 1e3
