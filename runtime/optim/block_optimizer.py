"""The optimizer's face to the training step: it takes each block's (gradient, ready event) pair and says when
the block is updated.

[Note: the optimizer's face]
The step hands every finished block's gradient to ``submit`` (eager: as its drain is queued; deferred: after
backward, in forward order, with the clip coefficient) and asks ``wait_updated(b, step)`` before the next load
of block b copies its weights (a resident block's load orders its stream after the update instead:
``order_after``). Behind it the CPU AdamW worker (cpu_adamw.py) updates the blocks whose state lives in host RAM or
spill files, reading their spilled state ahead through its read-ahead, and the device AdamW (device_adamw.py) the
blocks ``Plan.resident_blocks`` keeps on the device. Nothing is handed back up: the step's loads ask, the optimizer
never calls into the step.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from megatrain.runtime.device.busy_events import BusyEvents
from megatrain.runtime.device.event_log import EventLog
from megatrain.runtime.device.streams import Event, Stream, Streams
from megatrain.runtime.model.templates import BlockLayout
from megatrain.runtime.optim.adamw_kernel import AdamHyper
from megatrain.runtime.optim.cpu_adamw import AdamJob, AdamWorker
from megatrain.runtime.optim.device_adamw import DeviceAdamW
from megatrain.runtime.state.host_store import HostStore


class Clip(NamedTuple):
    """A step's clip coefficient, ``clamp(max_norm / (norm + 1e-6), max=1)``, where each optimizer reads it."""

    host: torch.Tensor  # fp32 scalar in (pinned) host memory: the CPU AdamW's, once ``copied``
    copied: Event  # its D2H completion
    device: torch.Tensor  # fp32 scalar on the device, on the compute stream


class BlockOptimizer:
    """Every block's AdamW update ([Note: the optimizer's face])."""

    def __init__(self, store: HostStore, order: Sequence[int], layouts: Sequence[BlockLayout], log: EventLog,
                 streams: Streams, threads: int | None, inline: bool, device_busy: BusyEvents | None = None) -> None:
        """``order``: the blocks in the order every step's updates come (``StepSchedule.update_order``);
        ``layouts``: what each block's update covers (its layout, or this rank's shard of it); ``threads`` and
        ``inline``: the CPU worker's (cpu_adamw.py); ``device_busy``: times the device AdamW's updates in a timed
        step (the step timer's)."""
        self.store, self.layouts, self.log = store, list(layouts), log
        resident = store.resident
        self.device = None if resident is None else DeviceAdamW(resident, self.layouts, streams, log, device_busy)
        on_device = frozenset() if resident is None else resident.blocks
        self.cpu = AdamWorker(store, [b for b in order if b not in on_device], len(order), log,
                              threads=threads, inline=inline)

    @property
    def inline(self) -> bool:
        """Updates run in ``submit``, on the calling thread (``Plan.adam_thread == "compute"``)."""
        return self.cpu.inline

    def submit(self, step: int, block: int, grads: torch.Tensor | None, ready: Event, clip: Clip | None,
               hyper: AdamHyper, release: Callable[[], None] | None) -> None:
        """Block's gradient for ``step`` (``grads``: fp32 [numel] written once ``ready``; None: in its spill file),
        to update with ``clip``'s coefficient (None: unclipped); ``release`` once it is read."""
        self.log.record("adam_submit", step, block)
        if self.device is not None and block in self.device.updated:
            self.device.update(step, block, ready, None if clip is None else (clip.device, clip.copied), hyper)
            return
        self.cpu.submit(AdamJob(step, block, grads, ready, None if clip is None else (clip.host, clip.copied), hyper,
                                self.layouts[block], release))

    def wait_updated(self, block: int, step: int) -> None:
        """Block until block's update for ``step`` (and all before it) is done; a resident block's at once (its
        load waits on the device: ``order_after``)."""
        if self.device is None or block not in self.device.updated:
            self.cpu.wait_updated(block, step)

    def order_after(self, stream: Stream, block: int) -> None:
        """``stream`` waits for a resident block's last update (nothing for a block updated on the host)."""
        if self.device is not None and block in self.device.updated:
            self.device.order_after(stream, block)

    def wait_all(self, step: int) -> None:
        """Every block updated for ``step``: the state is quiet to read or write whole."""
        self.cpu.wait_all(step)
        if self.device is not None:
            self.device.synchronize()

    def restore(self, step: int) -> None:
        """After a checkpoint load, before any update: every block's update up to ``step`` counts as applied."""
        self.cpu.restore(step)

    def raise_if_failed(self) -> None:
        self.cpu.raise_if_failed()

    def take_skipped(self) -> list[int]:
        """Steps (each once) whose update was skipped for a non-finite gradient since the last call."""
        on_device = [] if self.device is None else self.device.take_skipped()
        return sorted(set(self.cpu.take_skipped()) | set(on_device))

    @property
    def busy_seconds(self) -> float | None:
        """The CPU AdamW's update seconds of the latest step whose updates all finished (None before the first)."""
        return self.cpu.busy_seconds

    def counters(self) -> dict[str, float]:
        """The spill disk's busy seconds and AdamW's waits for it ([Note: roofline]); empty when nothing spills."""
        disk = self.store.disk
        if disk is None:
            return {}
        return {**disk.busy_seconds(), "adam_disk_wait_s": self.cpu.disk_wait_seconds}

    def close(self) -> None:
        self.cpu.close()
