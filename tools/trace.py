"""``--trace``: a torch.profiler Chrome trace of a few steady-state steps.

The runtime labels each phase with its block (``h2d[7]``, ``fwd[7]``, ``bwd[7]``, ``adam[7]``),
so the timeline reads like the design. Open the file in chrome://tracing or https://ui.perfetto.dev.
"""
from __future__ import annotations

import torch

# Steps traced: the second to the fourth of the run (the first includes start-up).
FIRST_OFFSET, TRACED_STEPS = 2, 3


class StepTracer:
    def __init__(self, path: str, first_step: int, last_step: int, device: torch.device) -> None:
        self.path = path
        self.first = min(first_step + FIRST_OFFSET, last_step)
        self.last = min(self.first + TRACED_STEPS - 1, last_step)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=False)
        self._running = False
        self.written = False

    def before_step(self, step: int) -> None:
        if step == self.first:
            self._profiler.start()
            self._running = True

    def after_step(self, step: int, synchronize) -> None:
        """``synchronize`` waits for the step's queued work, so the trace holds whole steps."""
        if self._running and step >= self.last:
            self.close(synchronize)

    def close(self, synchronize=None) -> None:
        if not self._running:
            return
        if synchronize is not None:
            synchronize()
        self._profiler.stop()
        self._running = False
        self._profiler.export_chrome_trace(self.path)
        self.written = True

    def describe(self) -> str:
        return f"{self.path} (steps {self.first}-{self.last})" if self.written else "not written (run ended first)"
