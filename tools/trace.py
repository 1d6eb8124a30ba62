"""``--trace``: a torch.profiler Chrome trace of a few steady-state steps.

The runtime labels each phase with its block (``h2d[7]``, ``fwd[7]``, ``bwd[7]``, ``adam[7]``),
so the timeline reads like the design. Open the file in chrome://tracing or https://ui.perfetto.dev.
The run's summary also gets the traced steps' anatomy (``trace_anatomy.py``): compute, H2D, D2H
and AdamW seconds per step and the step's ratio to their maximum, the roofline.
"""
from __future__ import annotations

import time

import torch

from .trace_anatomy import anatomy, profile_kwargs

# Steps traced: the second to the fourth of the run (the first includes start-up).
FIRST_OFFSET, TRACED_STEPS = 2, 3


class StepTracer:
    def __init__(self, path: str, first_step: int, last_step: int, device: torch.device) -> None:
        self.path = path
        self.first = min(first_step + FIRST_OFFSET, last_step)
        self.last = min(self.first + TRACED_STEPS - 1, last_step)
        self._profiler = torch.profiler.profile(**profile_kwargs(device.type == "cuda"))
        self._running = False
        self._t0 = 0.0
        self._traced = 0  # whole steps inside the trace
        self.written = False
        self.anatomy: dict | None = None

    def before_step(self, step: int) -> None:
        if step == self.first:
            self._profiler.start()
            self._running = True
            self._t0 = time.perf_counter()

    def after_step(self, step: int, synchronize) -> None:
        """``synchronize`` waits for the step's queued work, so the trace holds whole steps."""
        if self._running:
            self._traced += 1
            if step >= self.last:
                self.close(synchronize)

    def close(self, synchronize=None) -> None:
        if not self._running:
            return
        if synchronize is not None:
            synchronize()
        elapsed = time.perf_counter() - self._t0
        self._profiler.stop()
        self._running = False
        self._profiler.export_chrome_trace(self.path)
        self.written = True
        if synchronize is not None and self._traced:
            self.anatomy = anatomy(self._profiler.events(), self._traced, elapsed / self._traced)

    def describe(self) -> str:
        if not self.written:
            return "not written (run ended first)"
        text = f"{self.path} (steps {self.first}-{self.last})"
        a = self.anatomy
        if a is not None and a["roofline_ratio"] is not None:
            text += (f"; per step: compute {a['compute_s']:.3f} s, H2D {a['h2d_s']:.3f} s, D2H {a['d2h_s']:.3f} s, "
                     f"AdamW {a['adam_s']:.3f} s; step {a['step_s']:.3f} s = {a['roofline_ratio']:.2f}x the "
                     f"roofline (bound by {a['bound_by']})")
        return text
