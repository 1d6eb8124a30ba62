"""The variants of a fitted candidate the search times beside it: the same plan with every layer recomputed, and
on a GPU (one process, or each data-parallel rank: its shard of a block's state) the plans that keep optimizer
state on the device (``Plan.resident_blocks``), traded against kept layers; each of those with its layers compiled
where the profile measured that faster (``compiled``). Pure stdlib.

[Note: resident trade]
Device memory holds either kept layers' activations (a recompute saved per layer) or resident blocks' state (16
bytes a parameter: the CPU AdamW's update, the weights' H2D and the gradients' D2H saved per block). Which pays more
depends on the step's bottleneck, so the search times both ends and lets the cost model pick: the candidate's kept
layers with the most first blocks resident that fit beside them, and every block resident with the most kept
layers that fit beside that; then, for the fastest of all, the points between: the most resident blocks beside 3/4,
1/2 and 1/4 of its kept layers (``traded``; only there, the search's time being the overview's). The step each
variant takes is the cost model's, and ``megatrain-plan plan`` prints
them (``commands/plan.py``).

Where host RAM is the binding limit (the fp32 state of every block does not fit it), resident blocks are what makes
a plan at all: the candidate first takes the fewest first blocks resident that let host RAM hold the rest
(``host_relief``), then the most kept layers that fit beside them, and the trade above runs from there: more resident
blocks for fewer kept layers, never fewer than host RAM needs (``resident_blocks.most_resident`` starts from the
plan's own).

Data-parallel ranks on GPUs trade the same way, each rank's plan at its shard: a resident block costs it 16 bytes a
parameter of its shard (``data_parallel.rank_components``) and saves its shard's H2D, D2H and CPU update, while
the block's all-gathers and reduce-scatter run as for any other block (``data_parallel.rank_cost``).
"""
from __future__ import annotations

from typing import Callable, Sequence

from megatrain.planner.costs import budget_boundary, kept_layers, resident_blocks
from megatrain.planner.costs.memory_model import Overrun
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload


def variants(model: ModelShape, work: Workload, plan: Plan, excess: Callable[[Plan], Sequence[int]],
             device_is_gpu: bool) -> list[Plan]:
    """The fitted ``plan``'s variants that fit (``excess``: a plan's bytes needed beyond each budget, at most 0
    where it fits; ``device_is_gpu``: the device is a GPU, where state may be
    resident, one process's or each data-parallel rank's shard of it): every layer recomputed (where it keeps some);
    the kept layers with the most resident blocks beside them; every block resident with the most kept layers beside
    it ([Note: resident trade])."""
    out = [plan.replace(kept_layers=())] if plan.kept_layers else []
    fits = budget_boundary.fitting(excess)
    if device_is_gpu and resident_blocks.may_hold(plan, work):
        most = resident_blocks.most_resident(model, plan, excess)
        if most.resident_blocks:
            out.append(most)
        every = plan.replace(resident_blocks=resident_blocks.first_blocks(model, model.num_layers + 2), kept_layers=())
        if len(most.resident_blocks) < model.num_layers + 2 and fits(every):
            out.append(kept_layers.keep_most(model, work, every, excess))
    return [p for p in out if fits(p)]


def host_relief(model: ModelShape, work: Workload, plan: Plan, over: Callable[[Plan], list[Overrun]],
                device_is_gpu: bool) -> Plan:
    """``plan`` with the fewest first blocks resident that bring host RAM within its budget, where host RAM is all it
    overruns (``over``: its overruns; ``device_is_gpu`` as in ``variants``) and it then fits every budget; else
    ``plan`` unchanged. Each block more moves its state (a rank's: its shard) from RAM to the device: host RAM falls
    and device memory grows block by block, so the fewest is found by bisection, at most log2(L + 2) + 2 calls of ``over``, and a count short of
    RAM that also overruns another budget ends it (fewer blocks are short of RAM, more overrun the device too)."""
    if not (device_is_gpu and resident_blocks.may_hold(plan, work)) or not _only_ram(over(plan)):
        return plan

    def with_count(r: int) -> Plan:
        return plan.replace(resident_blocks=resident_blocks.first_blocks(model, r))

    lo, hi = len(plan.resident_blocks), model.num_layers + 2  # with_count(lo) is short of RAM
    if _short_of_ram(over(with_count(hi))):
        return plan
    while hi - lo > 1:  # with_count(hi) is not short of RAM
        mid = (lo + hi) // 2
        overruns = over(with_count(mid))
        if _short_of_ram(overruns) and not _only_ram(overruns):
            return plan
        lo, hi = (mid, hi) if _short_of_ram(overruns) else (lo, mid)
    return plan if over(with_count(hi)) else with_count(hi)


def _short_of_ram(overruns: list[Overrun]) -> bool:
    return any(o.budget == "host RAM" for o in overruns)


def _only_ram(overruns: list[Overrun]) -> bool:
    """Short of host RAM and within every other budget."""
    return _short_of_ram(overruns) and all(o.budget == "host RAM" for o in overruns)


def traded(model: ModelShape, work: Workload, plan: Plan, excess: Callable[[Plan], Sequence[int]],
           device_is_gpu: bool) -> list[Plan]:
    """The fastest candidate's kept layers traded for resident blocks: the most first blocks resident beside 3/4,
    1/2 and 1/4 of its kept layers (the first in ``kept_layers.keep_order``), each that fits (``excess`` as in
    ``variants``) and holds one; at least the candidate's own resident blocks, which fit beside more kept layers
    (and may be what host RAM needs)."""
    if not (device_is_gpu and resident_blocks.may_hold(plan, work) and plan.kept_layers):
        return []
    order, k, out = kept_layers.keep_order(model, work), len(plan.kept_layers), []
    for fewer in sorted({k * 3 // 4, k // 2, k // 4} - {0, k}, reverse=True):
        some = resident_blocks.most_resident(model, plan.replace(kept_layers=tuple(order[:fewer])), excess)
        if some.resident_blocks and budget_boundary.fits(excess(some)):
            out.append(some)
    return out


def compiled(model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile) -> list[Plan]:
    """``plan`` with ``compiled_layers``, where ``hw`` measured a decoder layer faster compiled than eager in the
    workload's compute dtype (``HardwareProfile.compiled_speedup`` > 1: never on a profile that did not measure it),
    for a dense model's whole layers (the runtime compiles no sparse layer, sequence tile or expert group); else
    none. The memory model prices both alike (the compiled kernels' intermediates stand in for eager's), so it fits
    where ``plan`` does; the cost model times its layers' work at the measured speedup."""
    speedup = hw.compiled_speedup(work.compute_dtype)
    whole = not (plan.mlp_tile_tokens or plan.attention_tile_tokens or plan.expert_group_size)
    if plan.compiled_layers or speedup is None or speedup <= 1.0 or model.experts.num_experts or not whole:
        return []
    return [plan.replace(compiled_layers=True)]
