"""Device fp32 gradient accumulators and their drain to the host.

A block's gradients accumulate over its micro-batches in one fp32 device
buffer (zeroed on acquire), then drain to host memory on the d2h stream. The
buffer is reused only after the drain: the compute stream waits on the
``drained`` event before zeroing it again. Bound: ``count`` buffers of the
largest block (count x largest block x 4 bytes on the device); a tied
embedding has one more, kept from the head (forward) to the embedding
(end of backward). In place ([Note: compute in place], weight_slots.py) the
buffers hold nothing: a block's gradients add up in its host gradients
(``host_grads``), which its drain then leaves as they are.
"""
from __future__ import annotations

from typing import Callable

import torch

from megatrain.runtime.pipeline.step_timer import StepTimer
from megatrain.runtime.device.streams import Event, Streams


class GradBuffers:
    def __init__(self, count: int, numel: int, device: torch.device, streams: Streams, timer: StepTimer,
                 host_grads: Callable[[int], torch.Tensor] | None = None) -> None:
        """``host_grads``: in place, block b's host gradients (``numel`` is then 0)."""
        self.host_grads = host_grads
        self.buffers = [torch.zeros(numel, dtype=torch.float32, device=device) for _ in range(count)]
        self.drained: list[Event] = [streams.event() for _ in range(count)]
        self.streams = streams
        self.timer = timer
        self._next = 0

    def acquire(self, numel: int, block: int | None = None) -> tuple[int, torch.Tensor]:
        """A zeroed fp32 buffer [numel] for block ``block`` on the compute stream, its previous drain complete
        (in place: the block's host gradients)."""
        index = self._next
        self._next = (self._next + 1) % len(self.buffers)
        with self.timer.stall("d2h", self.streams.compute):
            self.streams.compute.wait_event(self.drained[index])
        if self.host_grads is not None:
            assert block is not None, "refused by Plan: compute_in_place with expert groups"
            buf = self.host_grads(block)
        else:
            buf = self.buffers[index][:numel]
        buf.zero_()
        return index, buf

    def drain(self, index: int | None, buf: torch.Tensor, host: torch.Tensor, after: Event | None = None) -> Event:
        """Copy ``buf`` (device fp32) into ``host`` (pinned fp32) after the compute that wrote it (or after
        ``after``, when another stream wrote it after that compute: a reduce-scatter).

        Returns the event a host thread synchronizes on before reading ``host``.
        """
        ready = self.streams.recorded(self.streams.compute) if after is None else after
        if buf.data_ptr() == host.data_ptr():  # in place: the gradients are where they drain to
            return ready
        with self.streams.d2h.use():
            self.streams.d2h.wait_event(ready)
            with self.timer.copy("d2h", self.streams.d2h):
                host.copy_(buf, non_blocking=True)
            done = self.streams.recorded(self.streams.d2h)
        if index is not None:
            self.drained[index] = done
        return done
