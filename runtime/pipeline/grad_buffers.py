"""Device fp32 gradient accumulators and their drain to the host.

A block's gradients accumulate over its micro-batches in one fp32 device
buffer (zeroed on acquire), then drain to host memory on the d2h stream. The
buffer is reused only after the drain: the compute stream waits on the
``drained`` event before zeroing it again. Bound: ``count`` buffers of the
largest block (count x largest block x 4 bytes on the device); a tied
embedding has one more, kept from the head (forward) to the embedding
(end of backward).
"""
from __future__ import annotations

import torch

from megatrain.runtime.pipeline.step_timer import StepTimer
from megatrain.runtime.device.streams import Event, Streams


class GradBuffers:
    def __init__(self, count: int, numel: int, device: torch.device, streams: Streams, timer: StepTimer) -> None:
        self.buffers = [torch.zeros(numel, dtype=torch.float32, device=device) for _ in range(count)]
        self.drained: list[Event] = [streams.event() for _ in range(count)]
        self.streams = streams
        self.timer = timer
        self._next = 0

    def acquire(self, numel: int) -> tuple[int, torch.Tensor]:
        """A zeroed fp32 buffer [numel] on the compute stream, its previous drain complete."""
        index = self._next
        self._next = (self._next + 1) % len(self.buffers)
        with self.timer.stall("d2h", self.streams.compute):
            self.streams.compute.wait_event(self.drained[index])
        buf = self.buffers[index][:numel]
        buf.zero_()
        return index, buf

    def drain(self, index: int | None, buf: torch.Tensor, host: torch.Tensor, after: Event | None = None) -> Event:
        """Copy ``buf`` (device fp32) into ``host`` (pinned fp32) after the compute that wrote it (or after
        ``after``, when another stream wrote it after that compute: a reduce-scatter).

        Returns the event a host thread synchronizes on before reading ``host``.
        """
        ready = self.streams.recorded(self.streams.compute) if after is None else after
        with self.streams.d2h.use():
            self.streams.d2h.wait_event(ready)
            with self.timer.copy("d2h", self.streams.d2h):
                host.copy_(buf, non_blocking=True)
            done = self.streams.recorded(self.streams.d2h)
        if index is not None:
            self.drained[index] = done
        return done
