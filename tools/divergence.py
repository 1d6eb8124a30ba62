"""When a ``megatrain-train`` run has diverged: its updates skipped, step after step, for a non-finite gradient.

The engine skips an update whose gradient holds NaN or infinity (``OptimizerConfig(skip_nonfinite=True)``), so
the masters stay as they were; one skipped step is a spike the run survives. ``WINDOW`` skipped steps in a row
(or every step of a shorter run) means the weights or the data make every loss non-finite: training on would
change nothing, and an exit status of 0 would call that success. The run stops there with ``EXIT_DIVERGED``
and one line saying so; its summary counts the skipped steps.
"""
from __future__ import annotations

from typing import Sequence

# The exit status of a run stopped because it diverged (0: done, 2: a bad option or input, 130: Ctrl-C).
EXIT_DIVERGED = 3
# Consecutive skipped steps that stop a run.
WINDOW = 10


class DivergenceWatch:
    """Watches the engine's skipped steps (``Engine.skipped_steps``, reported a step or so late) over one
    invocation of steps ``first``..``last``."""

    def __init__(self, first: int, last: int, window: int = WINDOW) -> None:
        self.window = max(1, min(window, last - first + 1))

    def diverged(self, skipped: Sequence[int]) -> str | None:
        """The line saying the run diverged when the last ``window`` skipped steps are consecutive; else None."""
        if len(skipped) < self.window:
            return None
        tail = sorted(skipped)[-self.window:]
        if tail[-1] - tail[0] != self.window - 1:
            return None
        return (f"training diverged: steps {tail[0]}-{tail[-1]} all had a non-finite gradient (NaN or inf) and "
                f"their updates were skipped, so the run stopped (exit status {EXIT_DIVERGED}); lower --lr, check "
                f"the data and the model's weights, or resume from an earlier checkpoint")


def elsewhere() -> str:
    """The line of a rank whose own skipped steps are not reported yet when another rank's show the run diverged."""
    return (f"training diverged: {WINDOW} updates in a row had a non-finite gradient (NaN or inf) and were skipped, "
            f"so the run stopped (exit status {EXIT_DIVERGED}); lower --lr, check the data and the model's weights")


def figures(skipped: Sequence[int], diverged: str | None) -> dict[str, object]:
    """summary.json's account of the skipped steps (this invocation's)."""
    return {"skipped_steps": len(skipped), "skipped_step_numbers": list(skipped)[:100], "diverged": diverged}
