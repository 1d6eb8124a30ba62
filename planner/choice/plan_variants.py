"""The variants of a fitted candidate the search times beside it: the same plan with every layer recomputed, and
on a GPU the plans that keep optimizer state on the device (``Plan.resident_blocks``), traded against kept layers.
Pure stdlib.

[Note: resident trade]
Device memory holds either kept layers' activations (a recompute saved per layer) or resident blocks' state (16
bytes a parameter: the CPU AdamW's update, the weights' H2D and the gradients' D2H saved per block). Which pays more
depends on the step's bottleneck, so the search times both ends and lets the cost model pick: the candidate's kept
layers with the most first blocks resident that fit beside them, and every block resident with the most kept
layers that fit beside that; then, for the fastest of all, the points between: the most resident blocks beside 3/4,
1/2 and 1/4 of its kept layers (``traded``; only there, the search's time being the overview's). The step each
variant takes is the cost model's, and ``megatrain-plan plan`` prints
them (``commands/plan.py``).
"""
from __future__ import annotations

from typing import Callable

from megatrain.planner.costs import kept_layers, resident_blocks
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload


def variants(model: ModelShape, work: Workload, plan: Plan, fits: Callable[[Plan], bool], on_gpu: bool) -> list[Plan]:
    """The fitted ``plan``'s variants that ``fits`` (``on_gpu``: one process on a GPU, where state may be resident):
    every layer recomputed (where it keeps some); the kept layers with the most resident blocks beside them; every
    block resident with the most kept layers beside it ([Note: resident trade])."""
    out = [plan.replace(kept_layers=())] if plan.kept_layers else []
    if on_gpu and resident_blocks.may_hold(plan, work):
        most = resident_blocks.most_resident(model, plan, fits)
        if most.resident_blocks:
            out.append(most)
        every = plan.replace(resident_blocks=resident_blocks.first_blocks(model, model.num_layers + 2), kept_layers=())
        if len(most.resident_blocks) < model.num_layers + 2 and fits(every):
            out.append(kept_layers.keep_most(model, work, every, fits))
    return [p for p in out if fits(p)]


def traded(model: ModelShape, work: Workload, plan: Plan, fits: Callable[[Plan], bool], on_gpu: bool) -> list[Plan]:
    """The fastest candidate's kept layers traded for resident blocks: the most first blocks resident beside 3/4,
    1/2 and 1/4 of its kept layers (the first in ``kept_layers.keep_order``), each that fits and holds one."""
    if not (on_gpu and resident_blocks.may_hold(plan, work) and plan.kept_layers):
        return []
    order, k, out = kept_layers.keep_order(model, work), len(plan.kept_layers), []
    for fewer in sorted({k * 3 // 4, k // 2, k // 4} - {0, k}, reverse=True):
        some = resident_blocks.most_resident(model, plan.replace(kept_layers=tuple(order[:fewer]), resident_blocks=()),
                                             fits)
        if some.resident_blocks and fits(some):
            out.append(some)
    return out
