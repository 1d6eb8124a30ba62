"""AdamW on the device for the resident blocks ([Note: resident blocks] in runtime/state/resident_state.py).

A resident block's fp32 master, m, v and gradient are device buffers; its update is torch's fused AdamW
(adamw_kernel.py, the kernel ``torch.optim.AdamW(fused=True)`` runs) on the views of those buffers, issued on the
``optim`` stream once the block's gradient is complete: eager, as soon as its backward is; deferred, in forward
order after backward, once the clip coefficient (a device scalar: no host round trip) is. With clipping the
gradient is first multiplied by the coefficient, as the CPU AdamW does. The next load of the block casts its master
into a slot on the h2d stream after the update's event (``order_after``): no host thread waits for a resident
block's update.

On a CPU device the streams are no-ops and the update runs at once on the calling thread: the same kernel on the
same views of fp32 buffers as the CPU AdamW's, so a plan with resident blocks trains the same bits as the host path.

[Note: non-finite updates on the device]
With ``skip_nonfinite`` the update is skipped on the device, without a host sync, where the CPU AdamW would skip it
(cpu_adamw.py's [Note: non-finite updates]): a device flag, 1 where the clip coefficient is NaN or 0 (clipping) or
the block's gradient holds a non-finite number (without), is the fused kernel's ``found_inf`` (it leaves master, m
and v as they are) and keeps the step count where it was. The flag is copied to the host behind the update; steps
whose flag has landed and is set are reported by ``take_skipped``.

The coefficient's device scalar is rewritten only in the next step's clipping, after that step's forward has
loaded every resident block, each load ordered after the block's update: no update still reads it then.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.profiler import record_function

from megatrain.plan.buffer_kinds import BufferKind

from megatrain.runtime.device.busy_events import BusyEvents
from megatrain.runtime.device.event_log import EventLog
from megatrain.runtime.device.streams import Event, Stream, Streams
from megatrain.runtime.model.templates import BlockLayout
from megatrain.runtime.optim.adamw_kernel import AdamHyper, fused_adamw
from megatrain.runtime.state.resident_state import ResidentState


class DeviceAdamW:
    """The resident blocks' updates on the ``optim`` stream, each leaving an event the block's next load waits on."""

    def __init__(self, resident: ResidentState, layouts: Sequence[BlockLayout], streams: Streams,
                 log: EventLog, busy: BusyEvents | None = None) -> None:
        """``busy``: times each update on the ``optim`` stream in a timed step (the step breakdown's
        ``device_adam_busy_s``)."""
        self.resident, self.layouts, self.streams, self.log = resident, layouts, streams, log
        self.busy = busy if busy is not None else BusyEvents(streams.cuda)
        self.updated: dict[int, Event] = {b: streams.event() for b in resident.blocks}  # each block's last update
        self._flags: list[tuple[int, torch.Tensor, Event]] = []  # (step, host copy of its skip flag, the copy's)

    def update(self, step: int, block: int, ready: Event, clip: tuple[torch.Tensor, Event] | None,
               hyper: AdamHyper) -> None:
        """Block's update for ``step`` once its gradient is ``ready`` (and ``clip``'s device coefficient, with its
        event, is written)."""
        r, stream = self.resident, self.streams.optim
        self.log.record("adam_begin", step, block)
        with stream.use(), record_function(f"adam[{block}]"):
            stream.wait_event(ready)
            if clip is not None:
                stream.wait_event(clip[1])
            with self.busy.around(stream):  # the update itself, after its waits
                grads = r.view(BufferKind.GRADS, block)
                if clip is not None:
                    grads.mul_(clip[0])
                count = r.steps[block]
                found = self._nonfinite(clip, grads) if hyper.skip_nonfinite else None
                count.add_(1 if found is None else 1 - found)
                flats = (r.view(BufferKind.MASTER, block), grads, r.view(BufferKind.EXP_AVG, block),
                         r.view(BufferKind.EXP_AVG_SQ, block))
                fused_adamw(hyper, self.layouts[block], 0, grads.numel(), flats, count, found)
            if found is not None:
                host = torch.empty((), dtype=torch.float32, pin_memory=self.streams.cuda)
                host.copy_(found, non_blocking=True)
                self._flags.append((step, host, self.streams.recorded(stream)))
            self.updated[block] = self.streams.recorded(stream)
        self.log.record("adam_end", step, block)

    @staticmethod
    def _nonfinite(clip: tuple[torch.Tensor, Event] | None, grads: torch.Tensor) -> torch.Tensor:
        """1.0 where the update is to be skipped, else 0.0 (a device scalar): the clip coefficient NaN or 0, or
        without clipping a non-finite number in the block's gradient."""
        ok = (torch.isfinite(clip[0]) & (clip[0] > 0)) if clip is not None else torch.isfinite(grads).all()
        return (~ok).to(torch.float32)

    def take_skipped(self) -> list[int]:
        """Steps (each once) with a skipped update whose flag has reached the host since the last call."""
        landed = [(step, host) for step, host, event in self._flags if event.done()]
        self._flags = [f for f in self._flags if not f[2].done()]
        return sorted({step for step, host in landed if float(host) > 0})

    def order_after(self, stream: Stream, block: int) -> None:
        """``stream`` waits for block's last update (a load casting its master)."""
        stream.wait_event(self.updated[block])

    def synchronize(self) -> None:
        """The host waits for every update issued (before the state is read or written whole)."""
        for event in self.updated.values():
            event.synchronize()
