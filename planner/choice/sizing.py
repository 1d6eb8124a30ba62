"""Sizing answers: what a machine can train, and what RAM (and NVMe) to buy, built from the plan search.

The search answers "the fastest plan for this workload on this hardware". The questions people ask
``megatrain-plan`` are one level up: which batch fits, with or without spilling to disk, on each RAM
size of a ladder; the least RAM that reaches a throughput; what spilling costs. Each answer here is a
set of searches, and each figure in it comes from a searched plan. With ``ranks`` (data parallel) the
batch is the global one (multiples of the W ranks), the RAM is a node's (G ranks share it: the search
judges them together) and the throughput is all ranks' with the collectives (data_parallel.scaling).
Pure stdlib.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatrain.planner.costs import cost_model, data_parallel
from megatrain.planner.choice import search
from megatrain.planner.profiling.hardware import GiB, HardwareProfile
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.planner.choice.search import PlanChoice
from megatrain.planner.shapes.workload import Workload

# Disk speed assumed for a spill disk nobody has measured (GB/s, read and write): a SATA-class SSD,
# well below any NVMe. ``megatrain-plan profile --spill-dir DIR`` measures the real one.
ASSUMED_DISK_GBPS = 1.0
# Share of installed RAM a run can use (the OS and page cache keep the rest); as in hardware.preset.
USABLE_RAM_FRACTION = 0.94
# The RAM sizes of the purchase table.
RAM_LADDER = tuple(n * GiB for n in (64, 128, 256, 512, 1024, 2048))
# Batches the overview tries, largest first, when none is given.
OVERVIEW_BATCHES = (16, 8, 4, 2, 1)
# Doubling the batch counts as "no longer faster" below this gain (throughput has saturated).
SATURATION_GAIN = 0.01


def with_disk(hw: HardwareProfile) -> tuple[HardwareProfile, bool]:
    """(hw with disk figures, whether they were measured): unmeasured disks get ASSUMED_DISK_GBPS."""
    if hw.disk_read_gbps > 0 and hw.disk_write_gbps > 0:
        return hw, True
    return hw.replace(disk_read_gbps=ASSUMED_DISK_GBPS, disk_write_gbps=ASSUMED_DISK_GBPS), False


def with_ram(hw: HardwareProfile, ram_bytes: int) -> HardwareProfile:
    """``hw`` with ``ram_bytes`` installed, USABLE_RAM_FRACTION of it usable by the run."""
    return hw.replace(host_ram_bytes=ram_bytes, host_available_bytes=int(ram_bytes * USABLE_RAM_FRACTION),
                      cgroup_limit_bytes=0)


def largest_batch(model: ModelShape, work: Workload, hw: HardwareProfile, max_batch: int, start: int = 1,
                  ranks: search.Ranks = None) -> int:
    """The largest batch ``start`` x a power of two (at most ``max_batch``; ``start`` must fit when > 1 and,
    with ``ranks``, divide among them) with a plan that fits; 0 when not even ``start`` does."""
    b = start
    if not search.fits(model, dataclasses.replace(work, batch=b), hw, ranks):
        return 0
    while b * 2 <= max_batch and search.fits(model, dataclasses.replace(work, batch=b * 2), hw, ranks):
        b *= 2
    return b


@dataclass(frozen=True)
class LadderRow:
    """One RAM size of the purchase table, without or with the NVMe: the largest batch that fits and
    the fastest plan at that batch (None when nothing fits)."""

    ram_bytes: int
    nvme: bool
    batch: int
    choice: PlanChoice | None


def ram_ladder(model: ModelShape, work: Workload, hw: HardwareProfile, max_batch: int,
               ladder: tuple[int, ...] = RAM_LADDER, ranks: search.Ranks = None) -> list[LadderRow]:
    """For each RAM size (a node's, with ``ranks``), with nothing spilled (``nvme`` False) and with spill
    allowed to ``work.spill_dir`` within ``work.spill_free_bytes`` (True): the largest batch and its plan."""
    return [ladder_row(model, work, hw, max_batch, nvme, ram, ranks) for nvme in (False, True) for ram in ladder]


def ladder_row(model: ModelShape, work: Workload, hw: HardwareProfile, max_batch: int, nvme: bool, ram: int,
               ranks: search.Ranks = None) -> LadderRow:
    """One row of ``ram_ladder``: with ``ram`` bytes of host RAM, without the NVMe (``nvme`` False) or with it,
    the largest batch that fits and the fastest plan at that batch. Each row is its own searches (no row reads
    another's), so rows can be searched side by side (``ram_answers``)."""
    w = work if nvme else dataclasses.replace(work, spill="none")
    h = with_ram(hw, ram)
    b = largest_batch(model, w, h, max_batch, 1 if ranks is None else ranks.world, ranks)
    choice = search.search(model, dataclasses.replace(w, batch=b), h, ranks).best if b else None
    if choice is not None and ranks is not None:
        choice = as_node(model, dataclasses.replace(w, batch=b), choice, h, ranks)
    return LadderRow(ram, nvme, b, choice)


@dataclass(frozen=True)
class TargetAnswer:
    """The least host RAM reaching a throughput target, without and with the NVMe; or, when no plan
    reaches it, the fastest plan found and why it cannot go faster."""

    target: float
    without_nvme: tuple[int, PlanChoice] | None     # (batch, plan) needing the least RAM, nothing spilled
    with_nvme: tuple[int, PlanChoice] | None        # the same with spill allowed (the ladder's, at its RAM sizes)
    fastest: tuple[int, PlanChoice] | None          # the fastest plan at any batch tried
    saturated: bool                                 # larger batches stopped helping before max_batch

    @property
    def reachable(self) -> bool:
        return self.without_nvme is not None or self.with_nvme is not None

    def bound(self, max_batch: int) -> str:
        """What keeps the fastest plan from going faster."""
        assert self.fastest is not None and self.fastest[1].cost is not None
        batch, c = self.fastest[0], self.fastest[1].cost
        if not self.saturated and batch * 2 > max_batch:
            return f"the batch limit (--max-batch {max_batch}); {c.bottleneck} is busiest"
        return f"{c.bottleneck} (MFU {c.mfu:.0%}); larger batches no longer help"


def least_ram_for(model: ModelShape, work: Workload, hw: HardwareProfile, target: float,
                  max_batch: int, ranks: search.Ranks = None, ladder: list[LadderRow] | tuple = ()) -> TargetAnswer:
    """The least host RAM reaching ``target`` tokens/s (all ranks', with the collectives).

    Nothing spilled: plan with unlimited host RAM at batches 1, 2, 4, ... (``in_ram_sweep``), and the ladder's
    rows without the NVMe, and keep the plan needing the least host RAM among those reaching the target. Spill
    allowed: the plans of ``ladder``
    (``ram_ladder``'s rows with the NVMe, each searched with that much RAM: with unlimited RAM a search spills
    nothing, so only a RAM size finds the plans that trade RAM for the disk) reaching the target, the one
    needing the least host RAM; so the answer is never more than the smallest ladder row reaching the target."""
    return answer_from(target, in_ram_sweep(model, work, hw, target, max_batch, ranks), ladder)


@dataclass(frozen=True)
class InRamSweep:
    """``in_ram_sweep``'s findings: the plan reaching the target with the least host RAM, the fastest plan, and
    whether doubling the batch stopped helping."""

    in_ram: tuple[int, PlanChoice] | None
    fastest: tuple[int, PlanChoice] | None
    saturated: bool


def in_ram_sweep(model: ModelShape, work: Workload, hw: HardwareProfile, target: float, max_batch: int,
                 ranks: search.Ranks = None) -> InRamSweep:
    """Nothing spilled, unlimited host RAM, batches 1, 2, 4, ... (W, 2W, 4W, ... with ``ranks``; until
    ``max_batch``, or until doubling the batch twice in a row no longer raises the throughput)."""
    unlimited = hw.replace(host_ram_bytes=1 << 60, host_available_bytes=1 << 60, cgroup_limit_bytes=0)
    in_ram: tuple[int, PlanChoice] | None = None
    fastest: tuple[int, PlanChoice] | None = None
    flat = 0
    batch = 1 if ranks is None else ranks.world
    while batch <= max_batch and flat < 2:
        w = dataclasses.replace(work, batch=batch, spill="none")
        fit, _ = search.feasible_choices(model, w, unlimited, ranks)
        if ranks is not None:
            fit = [as_node(model, w, c, hw, ranks) for c in fit]
        top = max(fit, key=_rate, default=None)
        if top is not None:
            gain = _rate(top) / _rate(fastest[1]) - 1 if fastest is not None else 1.0
            if fastest is None or gain > 0:
                fastest = (batch, top)
            flat = flat + 1 if gain < SATURATION_GAIN else 0
        least = min((c for c in fit if _rate(c) >= target), key=lambda c: c.memory.host_bytes, default=None)
        if least is not None and (in_ram is None or least.memory.host_bytes < in_ram[1].memory.host_bytes):
            in_ram = (batch, least)
        batch *= 2
    return InRamSweep(in_ram, fastest, flat >= 2)


def answer_from(target: float, sweep: InRamSweep, ladder: list[LadderRow] | tuple) -> TargetAnswer:
    """The answer from the in-RAM sweep and the ladder's rows (``least_ram_for``): without the NVMe, the plan
    needing the least host RAM among the sweep's and the rows without the NVMe that reach the target (a row searched
    with its RAM size may keep blocks' optimizer state on the GPU to fit it, which unlimited RAM never asks for);
    with the NVMe, among the rows with it."""
    def least(rows: list[tuple[int, PlanChoice]]) -> tuple[int, PlanChoice] | None:
        return min((bc for bc in rows if _rate(bc[1]) >= target), key=lambda bc: bc[1].memory.host_bytes, default=None)

    def searched(nvme: bool) -> list[tuple[int, PlanChoice]]:
        return [(r.batch, r.choice) for r in ladder if r.nvme == nvme and r.choice is not None
                and r.choice.cost is not None]

    spilled, plain = searched(True), searched(False)
    without_nvme = least(plain + ([sweep.in_ram] if sweep.in_ram is not None else []))
    fastest = sweep.fastest
    if spilled + plain and (fastest is None or max(_rate(c) for _, c in spilled + plain) > _rate(fastest[1])):
        fastest = max(spilled + plain, key=lambda bc: _rate(bc[1]))
    return TargetAnswer(target, without_nvme, least(spilled), fastest, saturated=sweep.saturated)


def as_node(model: ModelShape, work: Workload, choice: PlanChoice, hw: HardwareProfile,
            ranks: data_parallel.Topology) -> PlanChoice:
    """One rank's ``choice`` seen as what to buy: a node's memory (data_parallel.node_memory) and all ranks'
    step (``work`` global): data_parallel.scaling's step time on the global tokens; the phases stay the rank's."""
    assert choice.cost is not None
    s = data_parallel.scaling(model, work, choice.plan, hw, ranks)
    cost = dataclasses.replace(choice.cost, step_seconds=s.step_seconds, tokens=work.tokens,
                               model_flops=choice.cost.model_flops * ranks.world,
                               peak_tflops=choice.cost.peak_tflops * ranks.world)
    return dataclasses.replace(choice, memory=data_parallel.node_memory(choice.memory, hw, ranks), cost=cost)


def _rate(c: PlanChoice) -> float:
    assert c.cost is not None
    return c.cost.tokens_per_second


@dataclass(frozen=True)
class ModelAnswer:
    """What one machine does with one model: whether it trains in RAM alone, only with spill, or not at
    all; at which batch; and what the spill costs per step."""

    model: ModelShape
    batch: int                        # 0 when nothing fits
    choice: PlanChoice | None
    in_ram: bool                      # a plan spilling nothing fits at that batch
    spill_cost_seconds: float         # step time the chosen plan's spill adds (0 without spill)
    reason: str                       # why nothing fits, when nothing does
    longest_context: int              # at batch 1, spill allowed

    @property
    def fits(self) -> str:
        """"ram", "spill" or "no"."""
        if self.choice is None:
            return "no"
        return "ram" if self.choice.plan.spill == "none" else "spill"


def what_fits(model: ModelShape, work: Workload, hw: HardwareProfile,
              batches: tuple[int, ...] = OVERVIEW_BATCHES) -> ModelAnswer:
    """The largest of ``batches`` with a plan that fits (spilling to ``work.spill_dir`` where allowed),
    the fastest plan there, and whether it fits without spilling."""
    ctx = search.longest_context(model, hw, 1, work.compute_dtype, work.clipping, spill_dir=work.spill_dir,
                                 spill_free_bytes=work.spill_free_bytes)
    smallest = dataclasses.replace(work, batch=min(batches))
    for b in sorted(batches, reverse=True) if search.fits(model, smallest, hw) else ():
        w = dataclasses.replace(work, batch=b)
        if not search.fits(model, w, hw):
            continue
        best = search.search(model, w, hw).require()
        in_ram = best.plan.spill == "none" or search.fits(model, dataclasses.replace(w, spill="none"), hw)
        return ModelAnswer(model, b, best, in_ram, spill_cost_seconds(model, w, best, hw), "feasible", ctx)
    r = search.search(model, smallest, hw)
    return ModelAnswer(model, 0, None, False, 0.0, r.reason(), ctx)


# The Llama-3 family's widths (hidden, intermediate, heads, KV heads, tied embeddings), vocab 128256: the
# largest-model answer varies the layer count at each width and keeps the largest model that fits.
LLAMA_WIDTHS = ((2048, 8192, 32, 8, True), (3072, 8192, 24, 8, True), (4096, 14336, 32, 8, False),
                (5120, 17920, 40, 8, False), (6144, 21504, 48, 8, False), (8192, 28672, 64, 8, False))
MAX_LAYERS = 256


def llama_shape(hidden: int, intermediate: int, heads: int, kv_heads: int, tied: bool, layers: int) -> ModelShape:
    """A Llama-3-shaped model (vocab 128256, head_dim hidden / heads) with ``layers`` decoder layers."""
    return ModelShape(name=f"llama-{hidden}x{layers}", hidden_size=hidden, intermediate_size=intermediate,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, vocab_size=128256,
                      tie_word_embeddings=tied, rope_theta=500000.0, max_position_embeddings=131072)


@dataclass(frozen=True)
class LargestAnswer:
    """The largest Llama-shaped model with a plan that fits the machine's RAM and the spill disk's free space
    together (None: not even one layer fits), and that plan."""

    model: ModelShape | None
    choice: PlanChoice | None

    def to_dict(self) -> dict[str, object]:
        if self.model is None or self.choice is None:
            return {"params": 0}
        m, mem = self.model, self.choice.memory
        return {"params": m.params, "hidden_size": m.hidden_size, "num_layers": m.num_layers,
                "intermediate_size": m.intermediate_size, "spill": self.choice.plan.spill,
                "host_ram_bytes": mem.host_bytes, "device_bytes": mem.device_bytes, "nvme_bytes": mem.nvme_bytes}

    def line(self) -> str:
        """One line for people."""
        if self.model is None or self.choice is None:
            return "largest Llama-shaped model: none fits"
        m, mem = self.model, self.choice.memory
        return (f"largest Llama-shaped model with this RAM and disk: {m.params / 1e9:.2f}B (hidden {m.hidden_size}, "
                f"{m.num_layers} layers), {mem.nvme_bytes / 1e9:.1f} GB on disk")


def largest_llama(work: Workload, hw: HardwareProfile, widths: tuple = LLAMA_WIDTHS) -> LargestAnswer:
    """The largest Llama-shaped model (``widths``, any layer count up to MAX_LAYERS) that trains on ``hw`` with
    ``work`` (its spill directory and free bytes: the search fills RAM first and the disk with the rest, so RAM
    and disk together set the answer). Per width a binary search over the layer count (a layer more never needs
    less memory); the largest in parameters wins."""
    best: ModelShape | None = None
    for width in widths:
        def ok(layers: int) -> bool:
            return search.fits(llama_shape(*width, layers), work, hw)
        if not ok(1):
            continue
        lo, hi = 1, MAX_LAYERS + 1     # ok(lo); hi does not fit (or is past the limit)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        shape = llama_shape(*width, lo)
        if best is None or shape.params > best.params:
            best = shape
    if best is None:
        return LargestAnswer(None, None)
    return LargestAnswer(best, search.search(best, work, hw).require())


def spill_cost_seconds(model: ModelShape, work: Workload, choice: PlanChoice, hw: HardwareProfile) -> float:
    """What spilling adds to the step: the plan's step time minus the same plan's with nothing spilled
    (memory aside)."""
    assert choice.cost is not None
    if choice.plan.spill == "none":
        return 0.0
    resident = cost_model.estimate(model, work, choice.plan.replace(spill="none", spill_blocks=None, spill_dir=None),
                                   hw)
    return max(0.0, choice.cost.step_seconds - resident.step_seconds)
