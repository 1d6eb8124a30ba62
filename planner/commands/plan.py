"""``megatrain-plan plan``: the plan ``megatrain-train`` would run for a model, sequence and batch."""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from . import cli_args, data_parallel_report, report, report_plan
from ..profiling import disk_space
from ..shapes import model_shapes
from ..choice import search
from ..costs.cost_model import CostEstimate
from ..shapes.model_shapes import ModelShape
from ..choice.plan_request import ChosenPlan, PlanRequest, choose_plan
from ..choice.search import TIME_TOLERANCE, InfeasibleError, Ranks
from ..shapes.workload import Workload


def add_parser(sub: Any) -> None:
    sp = sub.add_parser("plan", help="choose the plan for a model, sequence and batch")
    cli_args.workload_args(sp, need_batch=True)
    cli_args.hardware_args(sp)
    sp.add_argument("--out", help="write the plan JSON the runtime executes")
    data_parallel_report.add_arguments(sp, cli_args.positive_int, cli_args.positive_float)
    cli_args.json_arg(sp)


def run(args: argparse.Namespace) -> None:
    model = model_shapes.resolve(args.model)
    hw = cli_args.resolve_hardware(args)
    work = cli_args.workload(args, cli_args.compute_dtype(args, hw), spill_dir=args.spill_dir,
                             free=local_free_bytes(args))
    ranks = data_parallel_report.topology_of(args, hw)  # several GPUs: the plan of one rank, on its share
    chosen = choose_plan(model, PlanRequest(work), hw, ranks)
    if args.out:
        chosen.plan.save(args.out)
    data, text = report_plan.page(model, work, chosen, ranks, args.out)
    unclipped = clipping_cost(model, work, chosen, ranks)
    if unclipped is not None:
        data["without_clipping"] = {"step_seconds": unclipped.step_seconds,
                                    "tokens_per_second": unclipped.tokens_per_second}
        text += (f"\nclipping keeps every update until backward ends, and the CPU AdamW bounds the step; without "
                 f"clipping (--no-clip) the updates overlap backward: step {report.seconds(unclipped.step_seconds)}, "
                 f"{report.rate(unclipped.tokens_per_second)}")
    if not chosen.hardware.device_is_host:
        data["resident_alternatives"], more = resident_alternatives(model, work, chosen, ranks)
        text += "\n" + more
    report.emit(args.json, data, text)


def clipping_cost(model: ModelShape, work: Workload, chosen: ChosenPlan, ranks: Ranks) -> CostEstimate | None:
    """The cost estimate of the same workload without clipping, where the CPU AdamW bounds the clipped step and
    the plan without it (eager updates during backward) is faster beyond the search's tolerance; else None."""
    cost = chosen.choice.cost
    if not work.clipping or cost is None or cost.bottleneck != "CPU AdamW":
        return None
    try:
        other = choose_plan(model, PlanRequest(dataclasses.replace(work, clipping=False)), chosen.hardware, ranks)
    except InfeasibleError:
        return None
    faster = other.choice.cost is not None and other.choice.cost.step_seconds < cost.step_seconds * (1 - TIME_TOLERANCE)
    return other.choice.cost if faster else None


def resident_alternatives(model: ModelShape, work: Workload, chosen: ChosenPlan,
                          ranks: Ranks = None) -> tuple[list[dict[str, Any]], str]:
    """How many blocks keep their optimizer state on the GPU and why ([Note: resident trade]): the fastest plan the
    search timed with none, with some and with every block resident, each with its kept layers; where none fits
    (host RAM too small for every block's state), the fewest that do and the host RAM the plans with none need.
    With ``ranks``: one rank's plans (its shard of each block's state), the host RAM a node's."""
    fit, _ = search.feasible_choices(model, work, chosen.hardware, ranks)
    fit += search.traded(model, work, chosen.hardware, ranks, fit)
    blocks = model.num_layers + 2
    best: dict[str, search.PlanChoice] = {}
    for c in fit:
        r = len(c.plan.resident_blocks)
        group = "none" if r == 0 else "every" if r == blocks else "some"
        if c.cost is not None and (group not in best or c.cost.step_seconds < best[group].cost.step_seconds):  # type: ignore[union-attr]
            best[group] = c
    rows = [{"resident_blocks": len(c.plan.resident_blocks), "kept_layers": len(c.plan.kept_layers),
             "step_seconds": c.cost.step_seconds, "optimizer_exposed_seconds": c.cost.optimizer_exposed_seconds,
             "device_bytes": c.memory.device_bytes} for c in best.values() if c.cost is not None]
    p = chosen.plan
    shard = "" if ranks is None else " of each rank's shard"
    text = (f"optimizer state on the GPU: {len(p.resident_blocks)} of {blocks} blocks (16 bytes a parameter{shard} "
            f"there: no CPU AdamW, weight H2D or gradient D2H for them); the fastest timed with "
            + "; ".join(f"{r['resident_blocks']} blocks: step {report.seconds(r['step_seconds'])} with "
                        f"{r['kept_layers']} of {model.num_layers} layers kept, AdamW exposed "
                        f"{report.seconds(r['optimizer_exposed_seconds'])}"
                        for r in sorted(rows, key=lambda r: r["resident_blocks"])))
    if "none" not in best and best:  # every plan that fits keeps some: host RAM does not hold all of the state
        fewest = min(len(c.plan.resident_blocks) for c in fit)
        least = search.minimum_memory(model, dataclasses.replace(work, spill="none"), chosen.hardware, ranks)["host"]
        fewer = "none" if fewest == 1 else f"fewer than {fewest} blocks"
        G, node = (1, "") if ranks is None else (ranks.gpus_per_node, f" per node ({ranks.gpus_per_node} ranks)")
        text += (f"; with {fewer}, no plan fits (the least host RAM{node} with none, nothing on disk: "
                 f"{report.gib(G * least.memory.host_bytes)} of {report.gib(chosen.hardware.host_budget_bytes)} "
                 f"usable)")
    return rows, text


def local_free_bytes(args: argparse.Namespace) -> int | None:
    """The free space of --spill-dir's disk when that disk is this machine's: the folder exists here, or the
    hardware is this machine (no GPU preset); None (not checked) for another machine's folder."""
    if not args.spill_dir or (cli_args.is_preset(args) and not os.path.isdir(args.spill_dir)):
        return None
    return disk_space.free_bytes(args.spill_dir)
