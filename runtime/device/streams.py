"""Streams and events, with the same interface on CUDA and on CPU.

On CUDA the step uses four streams so that weight loads, compute, gradient
drains and host checkpoint traffic overlap. On CPU every operation runs in program order, so streams are
no-ops and events are always complete: the same code path runs, and CI tests
it. Buffers that cross streams travel with the event that says they are ready
(no ``record_stream``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class Event:
    """A point in one stream's work that another stream (or the host) can wait for."""

    def __init__(self, cuda: bool) -> None:
        # blocking: a host thread that synchronizes (AdamW worker, spill writer) sleeps, not spins a core
        self._event = torch.cuda.Event(blocking=True) if cuda else None
        self.recorded = False

    def record(self, stream: "Stream") -> None:
        if self._event is not None:
            self._event.record(stream.raw)
        self.recorded = True

    def wait_on(self, stream: "Stream") -> None:
        """Make ``stream``'s later work wait for this event (no host sync)."""
        if self._event is not None and self.recorded:
            stream.raw.wait_event(self._event)

    def done(self) -> bool:
        """Whether the event has happened (no wait; an event never recorded, or on a CPU, has)."""
        return self._event is None or not self.recorded or self._event.query()

    def synchronize(self) -> None:
        """Block the calling host thread until the event has happened (worker threads only)."""
        if self._event is not None and self.recorded:
            self._event.synchronize()


class Stream:
    def __init__(self, raw: "torch.cuda.Stream | None") -> None:
        self.raw = raw

    def wait_event(self, event: Event) -> None:
        """Order this stream's later work after ``event`` (no host sync)."""
        event.wait_on(self)

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        if self.raw is None:
            yield
        else:
            with torch.cuda.stream(self.raw):
                yield


class Streams:
    """The five streams of a step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            # compute: the caller's current stream, so the step orders with the user's own work.
            self.compute = Stream(torch.cuda.current_stream(device))
            # h2d: weight loads into device slots, overlapping compute.
            self.h2d = Stream(torch.cuda.Stream(device))
            # d2h: gradient drains to pinned host memory, overlapping compute.
            self.d2h = Stream(torch.cuda.Stream(device))
            # ckpt: host activation checkpoints out and back in pieces, so gigabytes of them queue neither behind
            # nor in front of a block's weights or gradients ([Note: host checkpoints in pieces]).
            self.ckpt = Stream(torch.cuda.Stream(device))
            # optim: the resident blocks' AdamW on the device ([Note: resident blocks]), beside backward's compute.
            self.optim = Stream(torch.cuda.Stream(device))
        else:
            self.compute = self.h2d = self.d2h = self.ckpt = self.optim = Stream(None)

    def event(self) -> Event:
        return Event(self.cuda)

    def recorded(self, stream: Stream) -> Event:
        event = self.event()
        event.record(stream)
        return event
