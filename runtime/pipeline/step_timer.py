"""Where a step's time goes: compute, and what of the transfers and the optimizer is exposed.

On CUDA the copies run on their own streams; what costs time is the compute
stream waiting for them. Each such wait is bracketed by two timing events on
the compute stream, so its elapsed time is the stall (zero when the copy was
already done). Compute is the compute stream's span less its stalls. On a CPU
every copy runs in program order on the calling thread, so their host time is
what they cost. The exposed optimizer is the host blocked on the AdamW worker
(a block's update before its next load, an eager gradient slab) where it holds
the step up: on a CPU all of that host time; on CUDA only the compute stream's
idle time it causes (two timing events around the wait: while the GPU still
runs work queued before it, the wait costs nothing).

[Note: roofline]
Besides what is exposed, the timer keeps how long each resource was busy, for
the roofline ``max(compute, H2D, D2H, CPU AdamW)`` that a perfectly overlapped
step would take (with AdamW on the compute thread, ``max(compute + CPU AdamW, H2D, D2H)``): the H2D and D2H streams' copy time (a pair of timing events
around each copy on its stream, after the wait that orders it, so only the
copy counts; host time on a CPU) and the AdamW worker's update time (without
its waits for drains and disk reads, measured by the worker: the latest step
whose updates all finished). On CUDA ``compute_s`` is the compute stream's
span less its stalls, so it still holds kernel-launch gaps and other host
time that left the GPU idle: an upper bound of kernel time (a torch.profiler trace,
``benchmarks/step_anatomy.py``, gives the kernels' own sum).

The device AdamW (the resident blocks' updates on the ``optim`` stream) is one too:
``device_adam_busy_s``, a pair of timing events around each update on its stream, after
the waits that order it (``device/busy_events.py``; on a CPU device the updates run on
the compute thread, so their host seconds, which ``compute_s`` holds as well); 0 with
no resident block.

The disk (spill files) is a resource too: ``disk_read_busy_s`` /
``disk_write_busy_s`` are the seconds of the timed step during which a read /
a write was in flight (in steady state, one step's traffic, including the
writes behind and the deferred updates of the step before), the roofline takes
``disk_busy_s`` (either in flight; ``disk_busy_forward_s`` of it before the
step's forward ended, at ``forward_s`` host seconds into the step: the halves a
spilled step's disk work falls in), and ``disk_exposed_s`` is what the step
waited on the disk: loads reading the spilled fp32 master, plus the part of the
exposed optimizer time during which the worker itself waited on spill I/O
(moved out of ``adam_exposed_s``, so the exposed terms still add up); the two
parts are ``disk_load_exposed_s`` and ``disk_adam_exposed_s``.

[Note: opt-in timing]
Timing is asked for one step at a time (``arm()``, from
``Engine.time_next_step()``): only that step records timing events and reads
clocks. Every other step pays one attribute check per wait or copy; the waits
themselves are plain ``stream.wait_event`` calls, with or without timing.
Nothing here syncs during the step; ``breakdown()`` reads the events of the
last step (waiting for its end once) when someone asks, and is None when that
step was not timed.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, ContextManager, Iterator

import torch

from megatrain.runtime.device.busy_events import BusyEvents
from megatrain.runtime.device.streams import Stream

KINDS = ("h2d", "d2h", "ckpt", "adam", "disk")
# Cumulative counters read at a timed step's begin and end (``counters``): the disk's busy time (reads,
# writes, either) and the AdamW worker's seconds blocked on spill I/O.
COUNTERS = ("disk_read_busy_s", "disk_write_busy_s", "disk_busy_s", "adam_disk_wait_s")
LINKS = ("h2d", "d2h")  # the copy engines whose busy time bounds the step
_UNTIMED: ContextManager[None] = contextlib.nullcontext()  # what every bracket is in a step not timed


class StepTimer:
    def __init__(self, cuda: bool, adam_inline: bool = False) -> None:
        """``adam_inline``: AdamW runs on the compute thread (``Plan.adam_thread``), in series with compute."""
        self.cuda, self.adam_inline = cuda, adam_inline
        self._host = dict.fromkeys(KINDS, 0.0)  # CPU: host seconds, per kind
        self._stalls: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._busy: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # copies on the side streams
        self._busy_host = dict.fromkeys(LINKS, 0.0)  # CPU: host seconds of the copies, per link
        self._span: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        self._wall0 = 0.0
        self._wall = 0.0
        self._done: dict[str, float] | None = None
        self._pending = False
        self._armed = False  # the next step is timed
        self._active = False  # this step is timed (only a training step is: not evaluation's loads)
        self.counters: Callable[[], dict[str, float]] | None = None  # see COUNTERS
        self._counted = dict.fromkeys(COUNTERS, 0.0)
        self._forward: tuple[float, float] | None = None  # (host seconds, disk busy seconds) at the forward's end
        self.device_adam = BusyEvents(cuda)  # the device AdamW's updates (handed to it: it times them)

    def arm(self) -> None:
        """Time the next training step (see [Note: opt-in timing])."""
        self._armed = True

    def begin(self, compute: Stream) -> None:
        self._active, self._armed = self._armed, False
        self._pending, self._done = False, None  # the breakdown is the last step's: none until it is timed
        if not self._active:
            return
        self._host = dict.fromkeys(KINDS, 0.0)
        self._stalls, self._busy = [], []
        self._busy_host = dict.fromkeys(LINKS, 0.0)
        self._wall0 = time.perf_counter()
        self._counted = dict(self.counters()) if self.counters is not None else dict.fromkeys(COUNTERS, 0.0)
        self._forward = None
        self.device_adam.start()
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record(compute.raw)
            self._span = (start, start)

    def forward_end(self) -> None:
        """The step's forward is issued (on a CPU, done): its host seconds and the disk's busy seconds so far."""
        if not self._active:
            return
        busy = self.counters()["disk_busy_s"] - self._counted["disk_busy_s"] if self.counters is not None else 0.0
        self._forward = (time.perf_counter() - self._wall0, busy)

    def end(self, compute: Stream) -> None:
        if not self._active:
            return
        self._wall = time.perf_counter() - self._wall0
        now = self.counters() if self.counters is not None else self._counted
        self._counted = {k: now[k] - self._counted[k] for k in COUNTERS}
        self._active = False
        self.device_adam.stop()
        if self.cuda and self._span is not None:
            stop = torch.cuda.Event(enable_timing=True)
            stop.record(compute.raw)
            self._span = (self._span[0], stop)
        self._pending = True

    def stall(self, kind: str, stream: Stream) -> ContextManager[None]:
        """Bracket a ``stream.wait_event`` to time the stall it causes (CUDA; on a CPU the copies' host time is)."""
        if not (self._active and self.cuda):
            return _UNTIMED
        return self._events(self._stalls, kind, stream)

    def adam_wait(self, compute: Stream) -> ContextManager[None]:
        """Bracket a host wait for the AdamW worker: exposed optimizer time (on CUDA, the compute stream's idle)."""
        if not self._active:
            return _UNTIMED
        if self.cuda:
            return self._events(self._stalls, "adam", compute)
        return self._host_seconds("adam")

    def disk_wait(self, compute: Stream) -> ContextManager[None]:
        """Bracket a host wait for a spill read a load needs: exposed disk time."""
        if not self._active:
            return _UNTIMED
        if self.cuda:
            return self._events(self._stalls, "disk", compute)
        return self._host_seconds("disk")

    def copy(self, link: str, stream: Stream, kind: str | None = None) -> ContextManager[None]:
        """Time the copies issued inside on ``stream`` (``link``: "h2d" or "d2h"; enter after its waits) as that
        link's busy time, and on a CPU as exposed ``kind`` (default: the link) too."""
        if not self._active:
            return _UNTIMED
        if self.cuda:
            return self._events(self._busy, link, stream)
        return self._cpu_copy(link, kind or link)

    @contextlib.contextmanager
    def _events(self, into: list, kind: str, stream: Stream) -> Iterator[None]:
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream.raw)
        try:
            yield
        finally:
            after.record(stream.raw)
            into.append((kind, before, after))

    @contextlib.contextmanager
    def _host_seconds(self, kind: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._host[kind] += time.perf_counter() - t0

    @contextlib.contextmanager
    def _cpu_copy(self, link: str, kind: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - t0
            self._busy_host[link] += seconds
            self._host[kind] += seconds

    def breakdown(self, adam_busy: float | None = None) -> dict[str, float] | None:
        """Seconds of the last finished step (None when it was not timed): step, compute, exposed h2d / d2h / ckpt traffic / adam,
        and each resource's busy time with the roofline they imply (``adam_busy``: the worker's
        update seconds for a whole step, from the AdamWorker; the roofline leaves AdamW out without it)."""
        if not self._pending:
            if self._done is not None and adam_busy is not None and "adam_busy_s" not in self._done:
                self._done = self._with_roofline(self._done, adam_busy)
            return self._done
        if self.cuda and self._span is not None:
            self._span[1].synchronize()  # the only waits: when the caller asks, after the step
            for _, _, after in self._busy:  # copies on the side streams may end after the compute stream
                after.synchronize()
            span = self._span[0].elapsed_time(self._span[1]) / 1e3
            stalls = dict.fromkeys(KINDS, 0.0)
            for kind, before, after in self._stalls:
                stalls[kind] += before.elapsed_time(after) / 1e3
            exposed = stalls
            compute = max(0.0, span - sum(stalls.values()))
            step = max(self._wall, span)
            busy = dict.fromkeys(LINKS, 0.0)
            for link, before, after in self._busy:
                busy[link] += before.elapsed_time(after) / 1e3
        else:
            exposed = dict(self._host)
            step = self._wall
            compute = max(0.0, step - sum(exposed.values()))
            busy = dict(self._busy_host)
        adam_on_disk = min(exposed["adam"], self._counted["adam_disk_wait_s"])
        done = {"step_s": step, "compute_s": compute, "h2d_exposed_s": exposed["h2d"],
                "d2h_exposed_s": exposed["d2h"], "ckpt_traffic_s": exposed["ckpt"],
                "adam_exposed_s": exposed["adam"] - adam_on_disk, "disk_exposed_s": exposed["disk"] + adam_on_disk,
                "disk_load_exposed_s": exposed["disk"], "disk_adam_exposed_s": adam_on_disk,
                "h2d_busy_s": busy["h2d"], "d2h_busy_s": busy["d2h"], "device_adam_busy_s": self.device_adam.seconds(),
                "disk_read_busy_s": self._counted["disk_read_busy_s"],
                "disk_write_busy_s": self._counted["disk_write_busy_s"], "disk_busy_s": self._counted["disk_busy_s"]}
        if self._forward is not None:
            done["forward_s"], done["disk_busy_forward_s"] = self._forward
        self._pending = False
        self._done = self._with_roofline(done, adam_busy)
        return self._done

    def _with_roofline(self, done: dict[str, float], adam_busy: float | None) -> dict[str, float]:
        """Add ``adam_busy_s`` (when known), ``roofline_s`` = max of the resources, and step / roofline. AdamW on
        the compute thread (``adam_inline``) cannot overlap compute: its busy time adds to compute's instead."""
        out = {k: v for k, v in done.items() if k not in ("adam_busy_s", "roofline_s", "roofline_ratio")}
        resources = [out["compute_s"], out["h2d_busy_s"], out["d2h_busy_s"], out["disk_busy_s"],
                     out["device_adam_busy_s"]]
        if adam_busy is not None:
            out["adam_busy_s"] = adam_busy
            if self.adam_inline:
                resources[0] += adam_busy
            else:
                resources.append(adam_busy)
        out["roofline_s"] = max(resources)
        out["roofline_ratio"] = out["step_s"] / out["roofline_s"] if out["roofline_s"] > 0 else float("nan")
        return out
