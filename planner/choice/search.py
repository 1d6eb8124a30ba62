"""Plan search: the fastest Plan that fits every budget, or the budget that no plan fits.

The space (DESIGN.md section 5): micro-batch size (hence the micro-batch count
M = ceil(batch / size)), slots and prefetch depth (K = depth + 1: the runtime
never loads more than ``depth`` ahead, so a further slot would only cost
memory), checkpoint placement, eager vs deferred optimizer (deferred when
clipping), host grad slabs for eager mode, and the loss chunk (the largest that
fits: it costs memory, hardly time), and what spills to disk unless the workload
forces a shorthand ("none", "optimizer", "all"): RAM is filled first and the rest
goes to disk, block by block and kind by kind (``candidate_fit.fill``; spill_placement.py,
[Note: fill order]), so the largest model that trains is set by RAM and disk
together; and compiled layers where the profile measured them faster (``plan_variants.compiled``).

With ``ranks`` (a data-parallel Topology) the workload is the global step and the plan is one rank's:
candidates at the rank's share of the batch, time as data_parallel.rank_cost (the rank's step with its
shards' copies and updates and the collectives), memory as data_parallel.memory (host state sharded 1/W,
a resident block's device state at its shard), and the budgets per node: each rank's GPU memory against
one GPU, and the G ranks of a node together (their shards and each one's buffers) against the node's host
RAM and spill disk. On GPUs a rank's plans keep optimizer state on the device as one process's do
([Note: resident trade] in plan_variants.py).

Memory is checked first (cheap); only plans that fit are timed. Pure stdlib.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatrain.errors import MegatrainError

from megatrain.planner.costs import data_parallel, plan_memory
from megatrain.planner.choice import candidate_fit, plan_variants, side_by_side
from megatrain.planner.choice.candidate_fit import LOSS_CHUNKS, PlanChoice, fill, fit, rank_work
from megatrain.planner.costs.data_parallel import rank_cost  # a rank's step; with no ranks, one process's
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.planner.costs.memory_model import Overrun
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan, host_device_choices
from megatrain.plan.plan_checks import master_spills
from megatrain.planner.costs.plan_memory import memory as _memory, overruns
from megatrain.planner.choice.sequence_pieces import checkpoint_piece_tokens, sequence_tile_tokens
from megatrain.planner.choice.spill_choices import (most_staging, spill_chunk_bytes, spill_io_choices,
                                                    spill_staging_choices)
from megatrain.planner.shapes.workload import Workload

Ranks = data_parallel.Topology | None

PREFETCH_DEPTHS = (1, 2, 3)
HOST_GRAD_SLABS = (2, 4)
# Plans this close to the fastest count as equally fast (the cost model is not more precise than that).
TIME_TOLERANCE = 0.01
# The fewest candidates a forked process takes (``feasible_choices``): about 1 ms of arithmetic each, against
# about 50 ms to start a process; a search with fewer runs here.
CANDIDATES_APART = 64


class InfeasibleError(MegatrainError):
    """No plan fits. The message names each budget exceeded and by how much."""


@dataclass(frozen=True)
class SearchResult:
    """The best feasible plan, or (``best`` None) the overruns that every plan has."""

    best: PlanChoice | None
    considered: int
    # When infeasible: for each budget, the least any plan needs of it, when that is too much;
    # otherwise the overruns of the plan closest to fitting.
    overruns: tuple[Overrun, ...] = field(default=())
    # When infeasible and the closest plan is one of two routes (nothing on disk, or spilling): the overruns of
    # the other route's closest plan, with the route's name ("spilling to disk" / "with nothing on disk").
    other_route: tuple[str, tuple[Overrun, ...]] | None = None

    @property
    def feasible(self) -> bool:
        return self.best is not None

    def reason(self) -> str:
        if self.best is not None:
            return "feasible"
        text = "; ".join(o.message() for o in self.overruns)
        if self.other_route is not None:
            route, over = self.other_route
            text += f"; {route} instead: " + "; ".join(o.message() for o in over)
        return text

    def budgets(self) -> set[str]:
        """Every budget the explanation names, either route's."""
        other = self.other_route[1] if self.other_route is not None else ()
        return {o.budget for o in self.overruns + other}

    def require(self) -> PlanChoice:
        if self.best is None:
            raise InfeasibleError(f"no plan fits: {self.reason()}; use a smaller model, batch or sequence, "
                                  f"or more memory (--ram / --gpu-mem / --hardware)")
        return self.best


def micro_batch_sizes(batch: int) -> list[int]:
    """Powers of two up to the batch, the batch itself, and ceil(batch / M) for M = 1..8."""
    sizes = {batch}
    p = 1
    while p < batch:
        sizes.add(p)
        p *= 2
    sizes.update(-(-batch // m) for m in range(1, 9))
    return sorted(sizes)


def candidates(model: ModelShape, work: Workload, hw: HardwareProfile | None = None,
               one_process: bool = True) -> list[Plan]:
    """Every plan the search considers, before the loss chunk is chosen (chunk = micro-batch tokens).

    On a GPU in bf16 / fp16 each comes twice, with the weights rounded on the host and on the device (``casts``).
    Spill plans only where the workload names a spill directory (the search never picks one) and ``hw``
    has the disk's figures to time them with; a forced spill without those figures is refused. A CPU device
    (``hw``) in ``one_process`` gets ``host_device_choices``; data-parallel ranks copy and gather as on a GPU.
    """
    host = hw is not None and hw.device_is_host and one_process
    modes = ("deferred",) if work.clipping else ("eager", "deferred")
    disk = hw is not None and hw.disk_read_gbps > 0 and hw.disk_write_gbps > 0
    if work.spill in ("optimizer", "all") and not disk:
        raise InfeasibleError(f"spill={work.spill!r} needs the disk's read and write speed, which this hardware "
                              f"profile lacks: pass --nvme GBPS, or measure it with megatrain-plan profile "
                              f"--spill-dir {work.spill_dir}")
    spills = [s for s in work.spill_choices() if s == "none" or disk]
    chunk = spill_chunk_bytes(model, work.state_bytes)
    stagings = spill_staging_choices(model, chunk)
    out = []
    for mbs in micro_batch_sizes(work.batch):
        for depth in PREFETCH_DEPTHS:
            if depth + 1 > model.num_layers + 2:
                continue
            for ckpt in ("device", "host"):
                for mode in modes:
                    for slabs in (HOST_GRAD_SLABS if mode == "eager" else (2,)):
                        for spill in spills:
                            for staging in ((1,) if spill == "none" else stagings):
                                out.append(Plan(num_slots=depth + 1, prefetch_depth=depth, micro_batch_size=mbs,
                                                checkpoints=ckpt, optimizer_mode=mode, host_grad_slabs=slabs,
                                                loss_chunk_tokens=mbs * work.seq_len, spill=spill,
                                                mlp_tile_tokens=sequence_tile_tokens(work.seq_len),
                                                attention_tile_tokens=sequence_tile_tokens(work.seq_len),
                                                checkpoint_piece_tokens=checkpoint_piece_tokens(model, work, mbs)
                                                if ckpt == "host" else None,
                                                spill_dir=None if spill == "none" else work.spill_dir,
                                                spill_staging=staging, **spill_io_choices(hw),
                                                **host_device_choices(host, mode, spill),
                                                **({} if spill == "none" else {"spill_chunk_bytes": chunk})))
    return [p for plan in out for p in casts(plan, work, hw)]


def feasible_choices(model: ModelShape, work: Workload, hw: HardwareProfile,
                     ranks: Ranks = None) -> tuple[list[PlanChoice], list[PlanChoice]]:
    """(timed plans that fit, plans that do not fit with their overruns), over every candidate in order; with
    ``ranks``, one rank's plans, timed at its share of the batch. Each candidate is fitted and timed alone, so they
    are dealt to the cores side by side (``side_by_side``), at least ``CANDIDATES_APART`` to a process."""
    hands = side_by_side.dealt(candidates(model, rank_work(work, ranks), hw, ranks is None), CANDIDATES_APART)
    parts = side_by_side.run_apart([(_fitted, (model, work, hw, ranks, hand)) for hand in hands])
    fitted = sorted((c for part in parts for c in part), key=lambda c: c[0])  # the candidates' order
    fit = [choice for _, choices, _ in fitted for choice in choices]
    return fit, [miss for _, _, miss in fitted if miss is not None]


def _fitted(model: ModelShape, work: Workload, hw: HardwareProfile, ranks: Ranks,
            hand: list[tuple[int, Plan]]) -> list[tuple[int, list[PlanChoice], PlanChoice | None]]:
    """Each (index, candidate) of ``hand`` fitted (``candidate_fit.fit``): (index, its timed plans that fit: the candidate
    and its variants, the plan that does not fit or None)."""
    out = []
    rank = rank_work(work, ranks)
    for index, plan in hand:
        choice = fit(model, work, plan, hw, ranks)
        if not choice.feasible:
            out.append((index, [], choice))
            continue
        timed = [PlanChoice(choice.plan, choice.memory, rank_cost(model, work, choice.plan, hw, ranks))]
        # every layer recomputed (as fast where recompute is off the critical path, and then less memory wins the
        # tie); optimizer state on the device traded against kept layers ([Note: resident trade])
        for p in plan_variants.variants(model, rank, choice.plan, lambda q: plan_memory.excess(
                _memory(model, work, q, hw, ranks), work, hw, ranks), not hw.device_is_host):
            timed.append(PlanChoice(p, _memory(model, work, p, hw, ranks), rank_cost(model, work, p, hw, ranks)))
        # each with compiled layers where the profile measured them faster (after it: a tie keeps eager)
        timed += [PlanChoice(p, c.memory, rank_cost(model, work, p, hw, ranks))
                  for c in timed for p in plan_variants.compiled(model, rank, c.plan, hw)]
        out.append((index, timed, None))
    return out


def traded(model: ModelShape, work: Workload, hw: HardwareProfile, ranks: Ranks, fit: list[PlanChoice]) -> list[PlanChoice]:
    """``plan_variants.traded`` of the fastest of ``fit``, timed."""
    if not fit:
        return []
    best, rank = min(fit, key=lambda c: c.cost.step_seconds if c.cost else 0.0), rank_work(work, ranks)
    return [PlanChoice(p, _memory(model, work, p, hw, ranks), rank_cost(model, work, p, hw, ranks))
            for p in plan_variants.traded(model, rank, best.plan, lambda q: plan_memory.excess(
                _memory(model, work, q, hw, ranks), work, hw, ranks), not hw.device_is_host)]


def casts(plan: Plan, work: Workload, hw: HardwareProfile | None) -> tuple[Plan, ...]:
    """A candidate, and on a GPU in bf16 / fp16 the same with the weights rounded on the device
    (``Plan.weights_cast``: no rounding pass in the CPU AdamW and no shadow in RAM, 4 bytes a weight over PCIe
    instead of 2), a candidate of its own; not where a master spills, but an "auto" workload's candidate spilling
    everything has its twin at "optimizer", which ``fill`` fills within m and v, where no master spills."""
    if hw is None or hw.device_is_host or work.compute_bytes == 4:
        return (plan,)
    if master_spills(plan):
        return (plan, plan.replace(spill="optimizer", weights_cast="device")) if work.spill == "auto" else (plan,)
    return plan, plan.replace(weights_cast="device")


def least_memory(close: list[PlanChoice], device_is_host: bool) -> PlanChoice:
    """Of plans within TIME_TOLERANCE of the fastest, one with nothing on disk if there is one (the disk's figures
    are the model's least certain, and a 7B model with 243 GiB of RAM had spilled 4 GiB at no predicted cost),
    then the least GPU memory, then host RAM: the same speed with more headroom for what the memory model does
    not see. Where the device is the CPU its buffers are RAM too: the least of both together (a spilled 3.2B had
    taken 7.5 GiB more staging for 0.56 GiB fewer "device" bytes)."""
    if device_is_host:
        return min(close, key=lambda c: (c.memory.nvme_bytes > 0, c.memory.device_bytes + c.memory.host_bytes))
    return min(close, key=lambda c: (c.memory.nvme_bytes > 0, c.memory.device_bytes, c.memory.host_bytes))


def search(model: ModelShape, work: Workload, hw: HardwareProfile, ranks: Ranks = None) -> SearchResult:
    """The fastest plan that fits ``hw``; near-ties go to less GPU memory, then less host RAM (a CPU device: less
    RAM, the two together), and a spilled plan takes the most staging sets that fit if they cost no time
    (``spill_choices.most_staging``). With ``ranks``: one rank's plan for ``work`` (the global step), per node."""
    fit, misfit = feasible_choices(model, work, hw, ranks)
    fit += traded(model, work, hw, ranks, fit)  # the fastest's kept layers for resident blocks ([Note: resident trade])
    considered = len(fit) + len(misfit)
    if fit:
        fastest = min(c.cost.step_seconds for c in fit if c.cost is not None)
        close = [c for c in fit if c.cost is not None and c.cost.step_seconds <= fastest * (1 + TIME_TOLERANCE)]
        best = least_memory(close, hw.device_is_host)
        if best.plan.spill != "none":  # the most staging sets that fit, where they cost no time (spill_choices)
            deeper = best.plan.replace(spill_staging=most_staging(model, best.plan, lambda n: not overruns(
                _memory(model, work, best.plan.replace(spill_staging=n), hw, ranks), work, hw, ranks)))
            cost = rank_cost(model, work, deeper, hw, ranks)
            if cost.step_seconds <= fastest * (1 + TIME_TOLERANCE):
                best = PlanChoice(deeper, _memory(model, work, deeper, hw, ranks), cost)
        # The plan records the workload it was made for; the runtime refuses another one.
        best = PlanChoice(best.plan.replace(workload=rank_work(work, ranks).fingerprint(model)), best.memory, best.cost)
        return SearchResult(best, considered)
    return SearchResult(None, considered, *_explain(misfit, hw))


def fits(model: ModelShape, work: Workload, hw: HardwareProfile, ranks: Ranks = None) -> bool:
    """Whether any plan fits every budget (memory only; nothing is timed). Memory grows with the loss
    chunk, so each candidate is tried with its smallest chunk only, filled (``fill``) and with the fewest resident
    blocks that host RAM needs (``plan_variants.host_relief``), as the search fits it."""
    over, gpu = candidate_fit.over(model, work, hw, ranks), not hw.device_is_host
    for plan in candidates(model, rank_work(work, ranks), hw, ranks is None):
        filled = fill(model, work, plan, hw, ranks)
        if not over(plan_variants.host_relief(model, rank_work(work, ranks), filled, over, gpu)):
            return True
    return False


def longest_context(model: ModelShape, hw: HardwareProfile, batch: int = 1, compute_dtype: str = "bfloat16",
                    clipping: bool = True, limit: int = 1 << 22, spill_dir: str | None = None,
                    spill_free_bytes: int | None = None) -> int:
    """The longest sequence (a multiple of 1024, at most ``limit``) with a plan that fits; 0 if none.
    With ``spill_dir``, plans may spill there (within ``spill_free_bytes`` when known)."""
    def ok(seq: int) -> bool:
        return fits(model, Workload(seq, batch, compute_dtype, clipping, spill_dir=spill_dir,
                                    spill_free_bytes=spill_free_bytes), hw)

    if not ok(1024):
        return 0
    lo = 1024
    while lo * 2 <= limit and ok(lo * 2):
        lo *= 2
    hi = min(lo * 2, limit + 1024)          # lo fits; hi does not (or is past the limit)
    while hi - lo > 1024:
        mid = (lo + hi) // 2 // 1024 * 1024
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _explain(choices: list[PlanChoice], hw: HardwareProfile
             ) -> tuple[tuple[Overrun, ...], tuple[str, tuple[Overrun, ...]] | None]:
    """Why nothing fits: each budget that even its most frugal plan exceeds; if each budget alone can be
    met but never both at once, the overruns of the plan closest to fitting, and beside them the closest plan of
    the other route (spilling to disk, or nothing on disk) where it falls short elsewhere, preferring one within
    the budgets the closest exceeds: a model that needs more RAM than the machine has without spilling, and more
    disk than is free with it, says both."""
    out = []
    for budget in ("gpu memory", "host RAM", "NVMe"):
        needs = [min((o.needed for o in c.overruns if o.budget == budget), default=None) for c in choices]
        if all(n is not None for n in needs):
            # Every plan exceeds this budget; say by how little the most frugal one does.
            least = min(n for n in needs if n is not None)
            avail = next(o.available for o in choices[0].overruns if o.budget == budget)
            out.append(Overrun(budget, least, avail))
    if out:
        return tuple(out), None

    def rel_excess(c: PlanChoice) -> float:
        return sum(o.excess / max(o.available, 1) for o in c.overruns)

    closest = min(choices, key=rel_excess)
    spills = closest.memory.nvme_bytes > 0
    others = [c for c in choices if (c.memory.nvme_bytes > 0) != spills]
    if not others:
        return closest.overruns, None
    short = {o.budget for o in closest.overruns}
    # Best, the other route's closest plan within every budget this one exceeds (RAM met by spilling, say).
    apart = [c for c in others if not short & {o.budget for o in c.overruns}]
    other = min(apart or others, key=rel_excess)
    if {o.budget for o in other.overruns} == short:
        return closest.overruns, None
    return closest.overruns, ("with nothing on disk" if spills else "spilling to disk", other.overruns)


def minimum_memory(model: ModelShape, work: Workload, hw: HardwareProfile,
                   ranks: Ranks = None) -> dict[str, PlanChoice]:
    """The plans needing the least GPU memory ("gpu"), the least host RAM ("host", spilling where the
    workload allows it) and the least host RAM with nothing on disk ("host_no_spill"), budgets ignored,
    with the smallest loss chunk: what ``megatrain-plan size`` reports as the minimum to buy. With
    ``ranks``, one rank's memory (a node holds G of it)."""
    best: dict[str, PlanChoice] = {}
    for plan in candidates(model, rank_work(work, ranks), hw, ranks is None):
        p = plan.replace(loss_chunk_tokens=min(LOSS_CHUNKS[-1], plan.loss_chunk_tokens))
        mem = _memory(model, work, p, hw, ranks)
        keys = [("gpu", mem.device_bytes), ("host", mem.host_bytes)]
        if p.spill == "none":
            keys.append(("host_no_spill", mem.host_bytes))
        for key, value in keys:
            if key not in best or value < (best[key].memory.device_bytes if key == "gpu"
                                           else best[key].memory.host_bytes):
                best[key] = PlanChoice(p, mem, None)
    return best

