"""A plan's memory against the budgets, as the search asks it: one process's or one rank's estimate, priced once
per plan, and the budgets it overruns. Pure stdlib."""
from __future__ import annotations

from megatrain.plan.plan import Plan
from megatrain.planner.costs import data_parallel, memory_model
from megatrain.planner.costs.memory_model import MemoryEstimate, Overrun
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.planner.shapes.workload import Workload

Ranks = data_parallel.Topology | None


# memory's estimates by everything they read (never the RAM size: sizing asks one plan at many), up to ESTIMATES_KEPT.
ESTIMATES_KEPT = 4096
_ESTIMATES: dict[tuple, MemoryEstimate] = {}


class _Same:
    """A key part equal only to itself: a profile's calibration (its runs are dicts, not hashable) by identity;
    the key holds the object, so its id is never reused while the entry lives."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj


def memory(model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile, ranks: Ranks) -> MemoryEstimate:
    """One process's memory, or one rank's among ``ranks`` (``work`` the global step). The same object for the same
    model, workload, plan, ranks and what the memory model reads of ``hw`` (whether the device is the host, its
    calibrations): ``fits``, the search and sizing's RAM ladder price one plan several times."""
    key = (model, work, plan, ranks, hw.device_is_host, tuple(_Same(c) for c in hw.calibrations))
    found = _ESTIMATES.get(key)
    if found is None:
        if len(_ESTIMATES) >= ESTIMATES_KEPT:
            _ESTIMATES.clear()
        found = _ESTIMATES[key] = (memory_model.estimate(model, work, plan, hw) if ranks is None
                                   else data_parallel.memory(model, work, plan, hw, ranks))
    return found


def demands(mem: MemoryEstimate, work: Workload, hw: HardwareProfile, ranks: Ranks = None) -> list[Overrun]:
    """What ``mem`` (one rank's with ``ranks``) needs of each budget, exceeded or not: GPU memory and host RAM on
    ``hw`` (per node: G ranks share it), and the free space of the spill disk when the workload knows it (G ranks'
    files)."""
    out = mem.demands(hw) if ranks is None else data_parallel.node_demands(mem, hw, ranks)
    if work.spill_free_bytes is not None:
        out.append(Overrun("NVMe", mem.nvme_bytes * (1 if ranks is None else ranks.gpus_per_node),
                           work.spill_free_bytes))
    return out


def overruns(mem: MemoryEstimate, work: Workload, hw: HardwareProfile, ranks: Ranks = None) -> list[Overrun]:
    """The budgets ``mem`` exceeds (``demands`` whose need is the larger)."""
    return [d for d in demands(mem, work, hw, ranks) if d.excess > 0]


def excess(mem: MemoryEstimate, work: Workload, hw: HardwareProfile, ranks: Ranks = None) -> tuple[int, ...]:
    """Bytes ``mem`` needs beyond each budget (at most 0 where it fits): how far a plan is from fitting, as
    ``budget_boundary.last_fitting`` reads it."""
    return tuple(d.excess for d in demands(mem, work, hw, ranks))
