"""Device weight slots and the loader that fills them ahead of compute.

[Note: slot lifecycle]
A slot is one flat device buffer the size of the largest block, in the compute
dtype. Its states: FREE -> LOADING (H2D issued; ``loaded`` event recorded on the
h2d stream) -> IN_USE (compute waits on ``loaded``) -> FREE (``released``
recorded on the compute stream after the last kernel that reads it). An H2D
into a slot waits on that slot's ``released`` event, so the GPU never
overwrites weights still being read; the host never waits for either.

A step is a fixed sequence of loads (forward: embedding, layers, head, and the
embedding again for a tied head; backward: layers in reverse). Load j goes to
slot ``j % K``; it may be issued once load ``j - K`` was released, and the loader
keeps ``prefetch_depth`` loads ahead of the one computing. Memory: K x largest
block x compute-dtype bytes on the device.
"""
from __future__ import annotations

import enum
from typing import Callable, Sequence

import torch
from torch.profiler import record_function

from .event_log import EventLog
from .host_store import HostStore
from .step_timer import StepTimer
from .streams import Event, Streams


class SlotState(enum.Enum):
    FREE = "free"
    LOADING = "loading"
    IN_USE = "in_use"


class WeightSlots:
    def __init__(self, count: int, numel: int, dtype: torch.dtype, device: torch.device, streams: Streams) -> None:
        self.buffers = [torch.empty(numel, dtype=dtype, device=device) for _ in range(count)]
        self.state = [SlotState.FREE] * count
        self.block = [-1] * count
        self.loaded: list[Event] = [streams.event() for _ in range(count)]
        self.released: list[Event] = [streams.event() for _ in range(count)]

    def __len__(self) -> int:
        return len(self.buffers)

    def transition(self, slot: int, old: SlotState, new: SlotState) -> None:
        assert self.state[slot] is old, f"slot {slot} is {self.state[slot].value}, expected {old.value}"
        self.state[slot] = new


# Called on the h2d stream right after a block's weights are queued into a slot, so that
# per-slot extras (host-resident activation checkpoints) load under the same ``loaded`` event.
OnLoad = Callable[[int, int, int], None]  # (load index, block, slot)
# Whether load j's inputs exist yet (a backward load's checkpoints are written by forward).
CanIssue = Callable[[int], bool]


class WeightLoader:
    """Runs one step's load sequence through the slots, ``depth`` loads ahead of compute."""

    def __init__(
        self,
        slots: WeightSlots,
        store: HostStore,
        streams: Streams,
        depth: int,
        wait_updated: Callable[[int], None],
        log: EventLog,
        timer: StepTimer,
    ) -> None:
        assert 1 <= depth <= len(slots) - 1
        self.slots, self.store, self.streams, self.depth = slots, store, streams, depth
        self.wait_updated = wait_updated  # blocks until AdamW has written block b's new shadow
        self.log = log
        self.timer = timer
        self.step = 0
        self.sequence: list[tuple[int, str]] = []
        self.on_load: OnLoad | None = None
        self.can_issue: CanIssue | None = None
        self._issued = 0  # loads issued so far
        self._released: list[bool] = []
        self._horizon = -1  # highest load index the compute has asked for

    def start(self, step: int, sequence: Sequence[tuple[int, str]], on_load: OnLoad | None = None,
              can_issue: CanIssue | None = None) -> None:
        """Begin a sequence of (block, phase) loads; nothing may be resident from the previous one."""
        assert all(s is SlotState.FREE for s in self.slots.state), "slots still resident from a previous sequence"
        self.step, self.sequence, self.on_load, self.can_issue = step, list(sequence), on_load, can_issue
        self._issued, self._released, self._horizon = 0, [False] * len(self.sequence), -1
        self._prefetch()

    def acquire(self, j: int) -> torch.Tensor:
        """The slot buffer holding load j, with the compute stream ordered after its H2D."""
        self._horizon = max(self._horizon, j)
        self._prefetch()
        assert j < self._issued, f"load {j} could not be issued: its slot is still in use"
        slot = j % len(self.slots)
        self.slots.transition(slot, SlotState.LOADING, SlotState.IN_USE)
        self.timer.wait("h2d", self.slots.loaded[slot], self.streams.compute)
        block, phase = self.sequence[j]
        self.log.record("compute", self.step, block, slot=slot, load=j, phase=phase)
        return self.slots.buffers[slot]

    def release(self, j: int) -> None:
        """Compute has issued its last use of load j: the slot may be refilled once the GPU gets there."""
        slot = j % len(self.slots)
        self.slots.transition(slot, SlotState.IN_USE, SlotState.FREE)
        self.slots.released[slot].record(self.streams.compute)
        self._released[j] = True
        block, phase = self.sequence[j]
        self.log.record("release", self.step, block, slot=slot, load=j, phase=phase)
        self._prefetch()

    def _prefetch(self) -> None:
        limit = min(len(self.sequence) - 1, self._horizon + self.depth)
        while self._issued <= limit:
            j = self._issued
            if j >= len(self.slots) and not self._released[j - len(self.slots)]:
                return  # its slot is still in use; issued again after the next release
            if self.can_issue is not None and not self.can_issue(j):
                return  # its inputs are not written yet; tried again after the next release
            self._issue(j)
            self._issued += 1

    def _issue(self, j: int) -> None:
        block, phase = self.sequence[j]
        slot = j % len(self.slots)
        with self.timer.host("adam"):
            self.wait_updated(block)
        self.slots.transition(slot, SlotState.FREE, SlotState.LOADING)
        self.slots.block[slot] = block
        numel = self.store.numels[block]
        with self.streams.h2d.use(), record_function(f"h2d[{block}]"):
            self.slots.released[slot].wait_on(self.streams.h2d)
            with self.timer.busy("h2d", self.streams.h2d), self.timer.host("h2d"):
                self.slots.buffers[slot][:numel].copy_(self.store.shadow_of(block), non_blocking=True)
            if self.on_load is not None:
                self.on_load(j, block, slot)
            self.slots.loaded[slot].record(self.streams.h2d)
        self.log.record("h2d", self.step, block, slot=slot, load=j, phase=phase)
