"""A run's sizes checked before any work: the batch, the sequence length and the tokens, against the machine.

``choose`` is ``run_plan.choose`` made before the data is read or packed, so that a batch or a sequence no
plan can hold is refused in one line (the planner's ``InfeasibleError``: each budget exceeded, the longest
sequence that fits) with the largest batch that fits added, instead of a batch of a billion rows being packed
first or a billion-token row allocated. A plan given (--plan) or resumed is not searched: its memory is
priced by the planner's memory model for this run's step and this machine, and refused the same way when it
does not fit. The memory figures are the planner's (planner/costs/memory_model.py, planner/choice/search.py); nothing here
estimates memory itself.
"""
from __future__ import annotations

import dataclasses
from megatrain.planner.costs import memory_model
from megatrain.planner.shapes import model_shapes
from megatrain.planner.choice import search, sizing
from megatrain.plan.plan import Plan
from megatrain.planner.profiling.profiler import this_machine
from megatrain.planner.shapes.workload import Workload
from megatrain.runtime import ModelConfig
from megatrain.runtime.distributed.process_group import Topology

from . import run_plan
from .train_config import TrainConfig


def choose(c: TrainConfig, values: dict[str, object], out: str, resumed: Plan | None, model: ModelConfig,
           compute_dtype: str, topology: Topology | None, replan: bool = False,
           on_cpu: bool = False) -> run_plan.RunPlan:
    """``run_plan.choose``, refused in one line naming the largest batch that fits when no plan holds the step."""
    shape = model_shapes.of_model(model, name=run_plan.planner_name(c.model))
    try:
        chosen = run_plan.choose(c, values, out, resumed, model, compute_dtype, topology, replan, on_cpu)
    except search.InfeasibleError as e:
        raise search.InfeasibleError(f"{e}{_largest_batch(c, shape, compute_dtype, out, topology)}") from None
    if topology is None or topology.world_size == 1:
        _check_fits(c, shape, chosen.plan, compute_dtype, out)
    return chosen


def _check_fits(c: TrainConfig, shape: model_shapes.ModelShape, plan: Plan, compute_dtype: str, out: str) -> None:
    """A plan given or resumed (a searched one fits by construction): its memory for this run's step, priced by
    the planner for this machine; one line naming each budget exceeded and the largest batch that fits."""
    hw = this_machine()
    work = run_plan.workload(c, compute_dtype, run_plan.spill_dir(c, out))
    over = search.overruns(memory_model.estimate(shape, work, plan, hw), work, hw)
    if not over:
        return
    needs = "; ".join(f"{o.budget}: needs {o.needed / 2**30:.2f} GiB, has {o.available / 2**30:.2f} GiB"
                      for o in over)
    raise search.InfeasibleError(f"the plan does not fit this step of {c.batch} x {c.seq_len} tokens on this "
                                 f"machine ({needs}){_largest_batch(c, shape, compute_dtype, out, None)}; lower "
                                 f"--batch or --seq-len, or leave --plan out to let the planner choose")


def _largest_batch(c: TrainConfig, shape: model_shapes.ModelShape, compute_dtype: str, out: str,
                   topology: Topology | None) -> str:
    """The largest batch (a power of two below --batch) with a plan that fits at this --seq-len, as a hint."""
    hw = this_machine()
    work: Workload = run_plan.workload(c, compute_dtype, run_plan.spill_dir(c, out))
    ranks = run_plan.planner_ranks(hw, topology)
    start = 1 if ranks is None else ranks.world
    if c.batch <= start:
        return ""
    batch = sizing.largest_batch(shape, dataclasses.replace(work, batch=start), hw, c.batch - 1, start, ranks)
    if not batch:
        return ""
    return f"; the largest batch that fits at --seq-len {c.seq_len} is about {batch:,} (--batch {batch})"
