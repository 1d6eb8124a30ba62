"""Fitting one candidate of the plan search to the budgets: expert groups whose layers fit the GPU, RAM filled first
and the rest spilled (``fill``), resident blocks where host RAM binds, the most kept layers, the largest loss chunk
(``fit``). Each "most" or "least" is the last setting of a row that fits (``budget_boundary.last_fitting``).
Pure stdlib.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatrain.models import registry

from megatrain.planner.costs import budget_boundary, data_parallel, kept_layers, plan_memory, spill_placement
from megatrain.planner.choice import plan_variants
from megatrain.planner.costs.cost_model import CostEstimate
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.planner.costs.memory_model import MemoryEstimate, Overrun
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan
from megatrain.planner.costs.plan_memory import memory as _memory, overruns
from megatrain.planner.shapes.workload import Workload

Ranks = data_parallel.Topology | None

LOSS_CHUNKS = (8192, 4096, 2048, 1024, 512, 256, 128, 64)


@dataclass(frozen=True)
class PlanChoice:
    plan: Plan
    memory: MemoryEstimate
    cost: CostEstimate | None     # None when the plan does not fit (not timed)
    overruns: tuple[Overrun, ...] = ()

    @property
    def feasible(self) -> bool:
        return not self.overruns


def chunks(tokens: int) -> list[int]:
    return [tokens] + [c for c in LOSS_CHUNKS if c < tokens]


def rank_work(work: Workload, ranks: Ranks) -> Workload:
    """The workload one rank plans for: all of it alone, its share among ``ranks``."""
    return work if ranks is None else data_parallel.rank_workload(work, ranks)


def fill(model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile, ranks: Ranks = None,
         chunk: int | None = None) -> Plan:
    """RAM first, the rest on disk: for a candidate of an "auto" workload that spills (``plan.spill`` "all", or
    "optimizer": its weights cast on the device from masters that stay in RAM, levels 1..nb only), the
    plan at the least fill level (spill_placement.at_level, from 1) whose memory fits the GPU and host RAM with
    loss chunk ``chunk`` (default: the smallest); the plan unchanged (at its top level) when none does. The
    least such level also puts the least on disk, so if its files overrun the disk's free space, every level
    that fits RAM does. Other plans: unchanged.

    Within one group of the fill (m and v, masters, grads: levels g x nb + 1 .. (g + 1) x nb) host RAM falls
    level by level, each level moving one more block of the group's kinds to disk; only the group's first level
    adds the staging of its newly spilled kinds (P x Ck x s_k each; the grads also their S x Ck x 4 slabs) back.
    So the first group whose last level fits holds the least level that fits, and within it
    ``budget_boundary.last_fitting`` finds it in about 4 memory estimates (bisection: 3 + log2(nb))."""
    if work.spill != "auto" or plan.spill not in ("optimizer", "all"):
        return plan
    host = hw.device_is_host and ranks is None  # a CPU device in one process: plan.host_device_choices
    chunk = chunks(plan.micro_batch_size * work.seq_len)[-1] if chunk is None else chunk

    def demands(level: int) -> list[Overrun]:  # GPU memory and host RAM: the disk's space is checked after
        p = spill_placement.at_level(plan, model, level, host).replace(loss_chunk_tokens=chunk)
        return [d for d in plan_memory.demands(_memory(model, work, p, hw, ranks), work, hw, ranks)
                if d.budget != "NVMe"]

    nb = model.num_layers + 2
    top = nb if plan.spill == "optimizer" else spill_placement.fill_levels(model, plan.optimizer_mode == "deferred")
    hi = None
    for end in range(nb, top + 1, nb):
        missing = [d for d in demands(end) if d.excess > 0]
        if not missing:
            hi = end
            break
        if not host and any(o.budget == "gpu memory" for o in missing):
            break  # unless compute runs in place, the placement moves no device byte: no level fits the GPU
    if hi is None:
        return plan
    # hi fits; the least level that fits lies in [hi - nb + 1, hi], where RAM falls level by level by about one
    # block's state: the last that fits counting down from hi (budget_boundary.last_fitting, on -level)
    least = budget_boundary.last_fitting(range(-hi, -hi + nb), lambda x: [d.excess for d in demands(-x)])
    return spill_placement.at_level(plan, model, -least, host)


def expert_groups(model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile, ranks: Ranks = None) -> Plan:
    """The plan with the fewest expert groups (whole layers first: ``ExpertShape.group_sizes``) whose device
    memory fits the GPU with the smallest loss chunk; the smallest groups when none does (with groups, no MLP
    tiles: their layers ignore them). Whole layers for a dense model, on a CPU device, with data-parallel ranks
    (the runtime streams groups on one process) and for a family whose blocks do not compute in groups."""
    if (hw.device_is_host or ranks is not None or not model.experts.num_experts
            or not registry.family(model.model_type).expert_groups):
        return plan
    chunk = chunks(plan.micro_batch_size * work.seq_len)[-1]
    # On a GPU what spills moves no device byte: the device is priced with nothing spilled, so the candidates that
    # differ only in their spill settings share these estimates (_memory keeps them).
    unspilled = plan.replace(spill="none", spill_blocks=None, spill_dir=None, spill_staging=1,
                             spill_chunk_bytes=Plan.spill_chunk_bytes, loss_chunk_tokens=chunk)
    for g in model.experts.group_sizes():
        p = plan.replace(expert_group_size=g, mlp_tile_tokens=plan.mlp_tile_tokens if g is None else None)
        mem = _memory(model, work, unspilled.replace(expert_group_size=g, mlp_tile_tokens=p.mlp_tile_tokens), hw,
                      ranks)
        if mem.device_bytes <= hw.gpu_mem_bytes:
            return p
    return p


def over(model: ModelShape, work: Workload, hw: HardwareProfile, ranks: Ranks) -> Callable[[Plan], list[Overrun]]:
    """A plan's overruns with its smallest loss chunk (the least memory it can take)."""
    return lambda p: overruns(_memory(model, work, _smallest_chunk(p, work), hw, ranks), work, hw, ranks)


def _excess(model: ModelShape, work: Workload, hw: HardwareProfile, ranks: Ranks) -> Callable[[Plan], tuple[int, ...]]:
    """A plan's bytes beyond each budget with its smallest loss chunk (``plan_memory.excess``)."""
    return lambda p: plan_memory.excess(_memory(model, work, _smallest_chunk(p, work), hw, ranks), work, hw, ranks)


def _smallest_chunk(plan: Plan, work: Workload) -> Plan:
    return plan.replace(loss_chunk_tokens=chunks(plan.micro_batch_size * work.seq_len)[-1])


def fit(model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile, ranks: Ranks = None) -> PlanChoice:
    """The plan in the fewest expert groups whose device memory fits (``expert_groups``), with the fewest blocks'
    optimizer state on the GPU that lets host RAM hold the rest where it binds (``plan_variants.host_relief``),
    keeping the most layers that fit with the smallest loss chunk (kept_layers.keep_most: a kept layer saves a
    recompute, a larger chunk hardly any time), then the largest loss chunk that fits (spilling
    the least that lets it: ``fill``; memory grows with the chunk, by chunk x V x (c + 12) bytes and the allocator's
    slack on them: ``budget_boundary.last_fitting``); else the smallest chunk, with its overruns."""
    plan = fill(model, work, expert_groups(model, work, plan, hw, ranks), hw, ranks)
    plan = plan_variants.host_relief(model, rank_work(work, ranks), plan, over(model, work, hw, ranks),
                                     not hw.device_is_host)
    plan = kept_layers.keep_most(model, rank_work(work, ranks), plan, _excess(model, work, hw, ranks))

    def at(chunk: int) -> tuple[Plan, MemoryEstimate]:
        p = plan.replace(loss_chunk_tokens=chunk)
        return p, _memory(model, work, p, hw, ranks)

    ascending = chunks(plan.micro_batch_size * work.seq_len)[::-1]
    largest = budget_boundary.last_fitting(ascending, lambda chunk: plan_memory.excess(at(chunk)[1], work, hw, ranks))
    p, mem = at(ascending[0] if largest is None else largest)
    return PlanChoice(p, mem, None, tuple(overruns(mem, work, hw, ranks)))
