"""The one way a plan is chosen: ``megatrain-plan plan`` prints it, ``megatrain-train`` runs it.

A ``PlanRequest`` holds every constraint the user put on the step: sequence, batch, dtype, clipping, what may
spill and where, the spill disk's free space (the ``Workload``), and whether a forced spill on a hardware
profile without the disk's figures is timed at an assumed speed. ``choose_plan`` searches with exactly these
constraints, so the plan it returns is the plan the search timed, and nothing changes it afterwards. When
no plan fits, its error names each budget exceeded and what would make one fit. Pure stdlib.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatrain.planner.choice import search, sizing
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan
from megatrain.planner.choice.search import InfeasibleError, PlanChoice, Ranks
from megatrain.planner.shapes.workload import Workload

# Forced spills: their kinds go to disk whatever the search would prefer.
FORCED_SPILLS = ("optimizer", "all")


@dataclass(frozen=True)
class PlanRequest:
    """What one run asks of the planner."""

    work: Workload
    # A forced spill (FORCED_SPILLS) on a profile without the disk's read and write GB/s: timed at
    # sizing.ASSUMED_DISK_GBPS (True: a run needs some plan), or refused with how to measure the disk (False).
    assume_disk_speed: bool = False


@dataclass(frozen=True)
class ChosenPlan:
    """The plan that runs, with the memory and time the search gave it."""

    choice: PlanChoice             # plan (with its workload fingerprint and spill folder), memory, cost
    hardware: HardwareProfile      # the profile it was timed on, an assumed disk speed included
    considered: int                # plans the search compared
    disk_speed_assumed: bool       # the disk's figures are sizing.ASSUMED_DISK_GBPS, not measured

    @property
    def plan(self) -> Plan:
        return self.choice.plan


def choose_plan(model: ModelShape, request: PlanRequest, hw: HardwareProfile, ranks: Ranks = None) -> ChosenPlan:
    """The fastest plan for ``request`` on ``hw`` (one rank's, with ``ranks``). Raises InfeasibleError: one
    line naming each budget no plan meets, with the fixes (a spill folder, its speed, a shorter sequence)."""
    work = request.work
    assumed = (request.assume_disk_speed and work.spill in FORCED_SPILLS
               and not (hw.disk_read_gbps > 0 and hw.disk_write_gbps > 0))
    if assumed:
        hw = hw.with_overrides(nvme_gbps=sizing.ASSUMED_DISK_GBPS)
    result = search.search(model, work, hw, ranks)
    try:
        best = result.require()
    except InfeasibleError as e:
        short = result.budgets()
        # Spilling moves host state to disk: it helps where host RAM is short, never GPU memory.
        more = ("; or a --spill-dir with more free space" if "NVMe" in short
                else _spill_hint(work, hw) if "host RAM" in short else "")
        raise InfeasibleError(f"{e}{more}{_longest_hint(model, work, hw)}") from None
    return ChosenPlan(best, hw, result.considered, assumed)


def _spill_hint(work: Workload, hw: HardwareProfile) -> str:
    """How spilling to disk could make an infeasible plan fit, when the request did not allow it."""
    if work.spill == "none":
        return ""
    if not work.spill_dir:
        return "; or let it spill to disk: --spill-dir DIR"
    if hw.disk_read_gbps <= 0 or hw.disk_write_gbps <= 0:
        return (f"; to spill to {work.spill_dir}, give the disk's speed: --nvme GBPS, or megatrain-plan profile "
                f"--spill-dir {work.spill_dir}")
    return ""


def _longest_hint(model: ModelShape, work: Workload, hw: HardwareProfile) -> str:
    """For a sequence that does not fit: the longest one that does, at this batch."""
    seq = search.longest_context(model, hw, work.batch, work.compute_dtype, work.clipping,
                                 limit=max(work.seq_len - 1024, 1024), spill_dir=work.spill_dir,
                                 spill_free_bytes=work.spill_free_bytes)
    return f"; the longest sequence that fits is {seq:,} tokens (--seq-len {seq})" if seq else ""
