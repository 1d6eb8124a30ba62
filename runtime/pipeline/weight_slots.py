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
slot ``j % K``; it may be issued once load ``j - K`` was released (and, for a
backward layer, once ``Load.after``, forward's last layer, was), and the loader
keeps ``prefetch_depth`` loads ahead of the one computing (step_schedule.py
builds the sequences). Compute holds a load inside
``with loader.resident(load)``: entering it is the LOADING -> IN_USE
transition, leaving it IN_USE -> FREE. Memory: K x largest block x
compute-dtype bytes on the device; with a layer streamed in parts ([Note: expert
groups]), a load is a part of its block (its ranges copied into the slot one
after another) and a slot the size of the largest part or other block.

In fp32 a block whose master is spilled has no copy of its weights in host RAM: its
load is a job for the loader thread ([Note: spilled loads], spilled_loads.py), which
waits for the block's update and reads it from the master spill file into the slot;
compute waits for the job when it acquires the slot.

[Note: compute in place]
Where the device is the CPU, a copy into a slot moves host RAM to host RAM. With
``Plan.compute_in_place`` a load copies nothing: the slot stands for the block's
weights where they are (the fp32 master, or the compute-dtype shadow), and the
block's gradients add up in its host gradients (grad_buffers.py). The slots and
the gradient buffers then hold nothing. The lifecycle and its order stay as they
are: a load still waits for the block's update, which writes those weights, and
the next update comes after the block's last use in the step (deferred mode).
"""
from __future__ import annotations

import contextlib
import enum
from typing import Callable, Iterator, Sequence

import torch
from torch.profiler import record_function

from megatrain.plan.buffer_kinds import BufferKind

from megatrain.runtime.device.event_log import EventLog
from megatrain.runtime.optim.block_optimizer import BlockOptimizer
from megatrain.runtime.state.host_store import HostStore
from megatrain.runtime.spill.spill_io import aligned_empty
from megatrain.runtime.pipeline.spilled_loads import SpilledLoad, SpilledLoads
from megatrain.runtime.pipeline.step_schedule import Load
from megatrain.runtime.pipeline.step_timer import StepTimer
from megatrain.runtime.device.streams import Event, Streams


class SlotState(enum.Enum):
    FREE = "free"
    LOADING = "loading"
    IN_USE = "in_use"


class WeightSlots:
    def __init__(self, count: int, numel: int, dtype: torch.dtype, device: torch.device, streams: Streams) -> None:
        # On a CPU the slots are host memory at SPILL_ALIGN-aligned addresses, so a spilled fp32 master is read
        # into them with O_DIRECT, chunk by chunk on every I/O thread.
        self.buffers = [torch.empty(numel, dtype=dtype, device=device) if device.type != "cpu" else
                        aligned_empty(numel * dtype.itemsize).view(dtype) for _ in range(count)]
        self.state = [SlotState.FREE] * count
        self.block = [-1] * count
        self.loaded: list[Event] = [streams.event() for _ in range(count)]
        self.released: list[Event] = [streams.event() for _ in range(count)]

    def __len__(self) -> int:
        return len(self.buffers)

    def transition(self, slot: int, old: SlotState, new: SlotState) -> None:
        assert self.state[slot] is old, f"slot {slot} is {self.state[slot].value}, expected {old.value}"
        self.state[slot] = new


# Data parallel: fills a slot on the h2d stream (collectives.py): ``place(own)`` writes this rank's shard into its
# part of the slot (from the RAM shadow, or read chunk by chunk from the master spill file), then the all-gather.
Fill = Callable[[int, torch.Tensor, Callable[[torch.Tensor], None]], None]  # (block, slot buffer, place)


class WeightLoader:
    """Runs one step's load sequence through the slots, ``depth`` loads ahead of compute.

    Compute holds a load with ``resident(load)``: entering acquires it (the compute stream ordered after
    its H2D), leaving releases its slot to the next load (FREE once the GPU is past its last reader).
    """

    def __init__(
        self,
        slots: WeightSlots,
        store: HostStore,
        streams: Streams,
        depth: int,
        optim: BlockOptimizer,
        log: EventLog,
        timer: StepTimer,
        fill: Fill | None = None,
        in_place: bool = False,
    ) -> None:
        """``optim``: asked whether a block is updated before its load; ``in_place``: compute reads each block's
        weights in host RAM ([Note: compute in place])."""
        assert 1 <= depth <= len(slots) - 1
        assert not (in_place and fill is not None), "data parallel gathers into slots"
        self.slots, self.store, self.streams, self.depth = slots, store, streams, depth
        self.optim = optim
        self.log = log
        self.timer = timer
        self.fill = fill
        self.in_place = in_place
        self._views: list[torch.Tensor | None] = [None] * len(slots)  # in place: the weights each slot stands for
        self.step = 0
        self.sequence: tuple[Load, ...] = ()
        self._issued = 0  # loads issued so far
        self._released: list[bool] = []
        self._horizon = -1  # highest load index the compute has asked for
        self._spilled: dict[int, SpilledLoad] = {}  # per slot: the loader thread's job filling it
        files = store.spill_files
        self.spilled_loads = None if files is None else SpilledLoads(
            files, streams, optim.wait_updated, timer, bounce=slots.buffers[0].device.type != "cpu", slots=len(slots))

    def start(self, step: int, sequence: Sequence[Load]) -> None:
        """Begin a sequence of loads for ``step``; nothing may be resident from the previous one."""
        assert all(s is SlotState.FREE for s in self.slots.state), "slots still resident from a previous sequence"
        assert all(load.index == j for j, load in enumerate(sequence)), "loads out of sequence"
        self.step, self.sequence = step, tuple(sequence)
        self._issued, self._released, self._horizon = 0, [False] * len(self.sequence), -1
        self._prefetch()

    @contextlib.contextmanager
    def resident(self, load: Load) -> Iterator[dict[str, torch.Tensor]]:
        """The block's weights (views of its slot, by local name) while compute uses them."""
        with self.resident_together((load,)) as (params,):
            yield params

    @contextlib.contextmanager
    def resident_together(self, loads: Sequence[Load]) -> Iterator[list[dict[str, torch.Tensor]]]:
        """Several loads resident at once (the head and a tied embedding): acquired, then released, in order."""
        params = [load.layout.views(self._acquire(load.index)) for load in loads]
        yield params
        for load in loads:
            self._release(load.index)

    def _acquire(self, j: int) -> torch.Tensor:
        """The slot buffer holding load j, with the compute stream ordered after its H2D."""
        self._horizon = max(self._horizon, j)
        self._prefetch()
        assert j < self._issued, f"load {j} could not be issued: its slot is still in use"
        slot = self._slot(j)
        self.slots.transition(slot, SlotState.LOADING, SlotState.IN_USE)
        job = self._spilled.pop(slot, None)
        if job is not None:  # [Note: spilled loads]
            with self.timer.adam_wait(self.streams.compute):
                job.updated.result()
            with self.timer.disk_wait(self.streams.compute):
                for read in job.landed.result():
                    read.result()
        with self.timer.stall("h2d", self.streams.compute):
            self.streams.compute.wait_event(self.slots.loaded[slot])
        load = self.sequence[j]
        self.log.record("compute", self.step, load.block.index, slot=slot, load=j, phase=load.phase, part=_part(load))
        view = self._views[slot]
        return self.slots.buffers[slot] if view is None else view

    def _release(self, j: int) -> None:
        """Compute has issued its last use of load j: the slot may be refilled once the GPU gets there."""
        slot = self._slot(j)
        self.slots.transition(slot, SlotState.IN_USE, SlotState.FREE)
        self.slots.released[slot].record(self.streams.compute)
        self._released[j] = True
        load = self.sequence[j]
        self.log.record("release", self.step, load.block.index, slot=slot, load=j, phase=load.phase, part=_part(load))
        self._prefetch()

    def _slot(self, j: int) -> int:
        return j % len(self.slots)  # [Note: slot lifecycle]: load j goes to slot j % K

    def _prefetch(self) -> None:
        limit = min(len(self.sequence) - 1, self._horizon + self.depth)
        while self._issued <= limit:
            j = self._issued
            if j >= len(self.slots) and not self._released[j - len(self.slots)]:
                return  # its slot is still in use; issued again after the next release
            after = self.sequence[j].after
            if after is not None and not self._released[after]:
                return  # its inputs are not written yet; tried again after the next release
            self._issue(j)
            self._issued += 1

    def _issue(self, j: int) -> None:
        load = self.sequence[j]
        block, slot = load.block.index, self._slot(j)
        source = self.store.load_source(block)
        spilled = source is None and self.fill is None  # a job for the loader thread: [Note: spilled loads]
        if not spilled:
            with self.timer.adam_wait(self.streams.compute):  # the previous step's update: what this load copies
                self.optim.wait_updated(block, self.step - 1)
            if source is None:  # data parallel, a spilled master: read on this thread once AdamW's write lands
                assert self.store.spill_files is not None
                with self.timer.disk_wait(self.streams.compute):
                    self.store.spill_files.wait_write(BufferKind.MASTER, block)
        self.slots.transition(slot, SlotState.FREE, SlotState.LOADING)
        self.slots.block[slot] = block
        numel = self.store.numels[block]
        with self.streams.h2d.use(), record_function(f"h2d[{block}]"):
            self.streams.h2d.wait_event(self.slots.released[slot])
            self.optim.order_after(self.streams.h2d, block)  # a resident block: cast on the device after its update
            if spilled:
                assert self.spilled_loads is not None and load.part is None
                self._spilled[slot] = self.spilled_loads.submit(block, self.step, self.slots.buffers[slot][:numel],
                                                                self.slots.loaded[slot])
            elif self.in_place:  # [Note: compute in place]: the block's weights where they are
                assert source is not None and load.part is None, "refused by Plan: compute_in_place"
                self._views[slot] = source
            else:
                with self.timer.copy("h2d", self.streams.h2d):
                    if load.part is not None:  # a part of the block ([Note: expert groups]): its ranges, in RAM
                        assert source is not None and self.fill is None, "refused by expert_parts.check_streamable"
                        for lo, n, at in load.part.ranges:
                            self.slots.buffers[slot][at:at + n].copy_(source[lo:lo + n], non_blocking=True)
                    elif self.fill is not None:  # data parallel: this rank's shard into its place, then the all-gather
                        self.fill(block, self.slots.buffers[slot], lambda own: self._place(block, source, own))
                    else:
                        self.slots.buffers[slot][:numel].copy_(source, non_blocking=True)
                self.slots.loaded[slot].record(self.streams.h2d)
        self.log.record("h2d", self.step, block, slot=slot, load=j, phase=load.phase, part=_part(load))

    def _place(self, block: int, source: torch.Tensor | None, out: torch.Tensor) -> None:
        """Data parallel: this rank's shard of block ``block`` into ``out`` on the h2d stream, copied from
        ``source`` in RAM, or read from the master spill file (landed on return: the all-gather follows)."""
        if source is not None:
            out.copy_(source, non_blocking=True)
            return
        assert self.spilled_loads is not None
        self.spilled_loads.read_now(block, out)

    def close(self) -> None:
        """Stop the loader thread (after the jobs it holds)."""
        if self.spilled_loads is not None:
            self.spilled_loads.close()


def _part(load: Load) -> int:
    """The event log's part number of a load: -1 the whole block, else ``Part.number``."""
    return -1 if load.part is None else load.part.number
