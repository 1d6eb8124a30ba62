"""The plan a ``megatrain-train`` run executes: ``--plan``, else the resumed run's, else the planner's, chosen by
``plan_request.choose_plan`` exactly as ``megatrain-plan plan`` chooses it (--spill and every other constraint
in the request, so the plan that runs is the plan the search timed). Spill files go under --spill-dir, else
OUT/spill."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from megatrain.planner.costs import data_parallel, spill_placement
from megatrain.planner.profiling import disk_space
from megatrain.planner.shapes import model_shapes
from megatrain.planner.choice import sizing
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.plan.plan import Plan, PlanError, host_device_choices
from megatrain.planner.choice.plan_request import PlanRequest, choose_plan
from megatrain.planner.profiling.profiler import this_machine
from megatrain.planner.shapes.workload import Workload
from megatrain.runtime import ModelConfig
from megatrain.runtime.distributed.process_group import Topology

from . import run_dir
from .train_config import TrainConfig


@dataclass
class RunPlan:
    """The plan, how the banner describes it, and what the summary notes about it."""

    plan: Plan
    description: str
    notes: list[str] = field(default_factory=list)
    collective_timeout_s: float | None = None  # under torchrun: --collective-timeout, else the plan's bound


def choose(c: TrainConfig, values: dict[str, object], out: str, resumed: Plan | None, model: ModelConfig,
           compute_dtype: str, topology: Topology | None, replan: bool = False, on_cpu: bool = False) -> RunPlan:
    """--plan, else the resumed run's plan (``resumed``), else the planner's for ``model``. --spill forces what
    spills (auto: the planner decides, or the plan given / resumed keeps its choice). ``values``: the options
    given explicitly; ``topology``: the ranks under torchrun (None: one process); ``replan``: search again even
    for a resumed run (it resumes at another world size, so its per-rank batch changed); ``on_cpu``: the run's
    device is the CPU (a plan given or resumed takes this run's CPU choices where they apply: ``_chosen``)."""
    spill_root = spill_dir(c, out)
    research = resumed is not None and (values.get("spill") == "auto" or replan)
    chosen = _chosen(c, values, out, resumed, model, compute_dtype, topology, spill_root, research, on_cpu)
    chosen.collective_timeout_s = _collective_timeout(c, model, chosen.plan, compute_dtype, topology)
    return chosen


def _chosen(c: TrainConfig, values: dict[str, object], out: str, resumed: Plan | None, model: ModelConfig,
            compute_dtype: str, topology: Topology | None, spill_root: str, research: bool, on_cpu: bool) -> RunPlan:
    if c.plan:
        plan, description = Plan.load(c.plan), c.plan
    elif resumed is not None and not research:
        plan, description = resumed, "the resumed run's"
    else:
        return _placed(_search(c, model, compute_dtype, spill_root, topology))
    spill = plan.spill if c.spill == "auto" else c.spill
    placed = dict(spill=spill, spill_blocks=plan.spill_blocks if spill == "blocks" else None,
                  spill_dir=None if spill == "none" else spill_root)
    # A CPU device's choices (compute in place, AdamW on the compute thread: the same bits either way) follow this
    # run's device and spill: a resumed plan's always, a given plan's where --spill leaves them invalid.
    choices = host_device_choices(on_cpu and topology is None, plan.optimizer_mode, spill)
    if c.plan:
        try:
            return _placed(RunPlan(plan.replace(**placed), description))
        except PlanError:
            pass  # its CPU choices and this spill exclude each other: this run's choices instead
    return _placed(RunPlan(plan.replace(**placed, **choices), description))


def spill_dir(c: TrainConfig, out: str) -> str:
    """Where the run's spill files go: --spill-dir, else OUT/spill."""
    return c.spill_dir or os.path.join(out, run_dir.SPILL_DIR)


def workload(c: TrainConfig, compute_dtype: str, spill_root: str) -> Workload:
    """The run's step as the planner sees it (what the search plans for)."""
    return Workload(c.seq_len, c.batch, compute_dtype=compute_dtype, clipping=c.max_grad_norm > 0,
                    spill=c.spill, spill_dir=spill_root, spill_free_bytes=disk_space.free_bytes(spill_root),
                    optimizer_state=c.optimizer_state, nonblocking_saves=c.save_every > 0)


def _search(c: TrainConfig, model: ModelConfig, compute_dtype: str, spill_root: str,
            topology: Topology | None) -> RunPlan:
    hw = this_machine()
    work = workload(c, compute_dtype, spill_root)
    shape = model_shapes.of_model(model, name=planner_name(c.model))
    chosen = choose_plan(shape, PlanRequest(work, assume_disk_speed=True), hw, planner_ranks(hw, topology))
    notes = []
    if chosen.disk_speed_assumed:
        notes.append(f"disk speed not measured: the plan assumes {sizing.ASSUMED_DISK_GBPS:g} GB/s (megatrain-plan "
                     f"profile --spill-dir {spill_root} measures it)")
    plan = chosen.plan
    description = (f"planner (hardware: {hw.source}): micro-batch {plan.micro_batch_size}, {plan.num_slots} slots, "
                   f"checkpoints on {plan.checkpoints}, {plan.optimizer_mode} optimizer"
                   f"{' on the compute thread' if plan.adam_thread == 'compute' else ''}"
                   f"{', computing in place' if plan.compute_in_place else ''}"
                   f"{', layers compiled' if plan.compiled_layers else ''}")
    return RunPlan(plan, description, notes)


def _collective_timeout(c: TrainConfig, model: ModelConfig, plan: Plan, compute_dtype: str,
                        topology: Topology | None) -> float | None:
    """Under torchrun, --collective-timeout, else the planner's bound on a collective's wait for this plan
    (planner/costs/data_parallel.py, [Note: collective timeout]); None for one process."""
    if topology is None or topology.world_size == 1:
        return None
    if c.collective_timeout:
        return c.collective_timeout
    hw = sizing.with_disk(this_machine())[0]  # an unmeasured disk at the rate the search assumes
    work = Workload(c.seq_len, c.batch, compute_dtype=compute_dtype, clipping=c.max_grad_norm > 0,
                    optimizer_state=c.optimizer_state)
    shape = model_shapes.of_model(model, name=planner_name(c.model))
    ranks = planner_ranks(hw, topology)
    assert ranks is not None
    return data_parallel.collective_timeout_s(shape, work, plan, hw, ranks)


def planner_name(model: str) -> str | None:
    """The name megatrain-plan gives ``--model`` (a preset's, or the folder of its config.json), which the plan's
    workload records; None where megatrain-plan has no name for it (the demo)."""
    try:
        return model_shapes.resolve(model).name
    except (model_shapes.ModelShapeError, OSError, ValueError):
        return None


def planner_ranks(hw: HardwareProfile, topology: Topology | None) -> data_parallel.Topology | None:
    """Under torchrun: the ranks as the planner sees them (one rank's plan, the node's RAM shared by its ranks);
    None for one process."""
    if topology is None or topology.world_size == 1:
        return None
    return data_parallel.topology(hw, topology.local_world_size, topology.world_size // topology.local_world_size)


def _placed(run_plan: RunPlan) -> RunPlan:
    plan = run_plan.plan
    if plan.spill != "none":
        kinds = {"optimizer": "AdamW m and v", "all": "master, m, v and grads"}.get(plan.spill)
        run_plan.description += f", spilling {kinds or spill_placement.label(plan)} to {plan.spill_dir}"
    return run_plan
