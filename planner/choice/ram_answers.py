"""``megatrain-plan ram``'s searches side by side.

Its answer is independent searches: each row of the RAM ladder, without the NVMe and with it
(``sizing.ladder_row``), and the sweep of batches with unlimited RAM and nothing spilled (``sizing.in_ram_sweep``).
They run side by side (``side_by_side.run_apart``: forked processes, as many as the cores, where this process can
fork), the rows with the NVMe (the longest) first. Either way the rows and the answer are
the ones ``sizing.ram_ladder`` and ``sizing.least_ram_for`` give: the same searches, only run apart. Pure stdlib.
"""
from __future__ import annotations

from typing import Any, Callable

from megatrain.planner.choice import search, sizing
from megatrain.planner.choice.side_by_side import run_apart
from megatrain.planner.choice.sizing import LadderRow, TargetAnswer
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.planner.shapes.workload import Workload


def ram_answers(model: ModelShape, work: Workload, hw: HardwareProfile, max_batch: int, target: float | None,
                ranks: search.Ranks = None) -> tuple[list[LadderRow], TargetAnswer | None]:
    """``sizing.ram_ladder``'s rows and, for a ``target`` in tokens/s, ``sizing.least_ram_for``'s answer."""
    rungs = [(nvme, ram) for nvme in (True, False) for ram in sizing.RAM_LADDER]
    jobs: list[tuple[Callable[..., Any], tuple]] = [
        (sizing.ladder_row, (model, work, hw, max_batch, nvme, ram, ranks)) for nvme, ram in rungs]
    if target is not None:
        jobs.append((sizing.in_ram_sweep, (model, work, hw, target, max_batch, ranks)))
    results = run_apart(jobs)
    rows = results[:len(rungs)]
    ladder = [r for r in rows if not r.nvme] + [r for r in rows if r.nvme]  # ram_ladder's order
    return ladder, None if target is None else sizing.answer_from(target, results[-1], ladder)
