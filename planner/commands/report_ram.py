"""What ``megatrain-plan ram`` prints: batch and throughput per RAM size with and without an NVMe, and the least
RAM (and its price) for a throughput target, as text and as JSON. Pure stdlib; formatting only."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatrain.planner.commands import data_parallel_report
from megatrain.planner.shapes import model_shapes
from megatrain.planner.choice import sizing
from megatrain.planner.profiling.hardware import GiB, HardwareProfile
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.planner.commands.report import choice_json, disk_text, gib, rate, spill_text, table
from megatrain.planner.choice.search import Ranks
from megatrain.planner.shapes.workload import Workload

# Assumed DDR5 RDIMM price when --price-per-gb is not given (USD per GB, 2025 street prices, rough).
DEFAULT_PRICE_PER_GB = 4.0
# RAM is bought in steps; round what a run needs up to a multiple of this.
RAM_STEP_BYTES = 32 * GiB


@dataclass(frozen=True)
class RamQuestion:
    """What ``ram`` was asked."""

    model: ModelShape
    work: Workload                 # batch 1: the ladder chooses the batch
    hw: HardwareProfile            # its disk's figures assumed where not measured
    disk_measured: bool
    nvme_size: int
    price_per_gb: float | None     # None: DEFAULT_PRICE_PER_GB, said to be assumed
    max_batch: int
    ranks: Ranks
    target: float | None           # tokens per second


def buy(need: int) -> int:
    """Installed RAM to buy for a run needing ``need`` bytes: usable share, whole RAM_STEP_BYTES steps."""
    return math.ceil(need / sizing.USABLE_RAM_FRACTION / RAM_STEP_BYTES) * RAM_STEP_BYTES


def page(q: RamQuestion, ladder: list[sizing.LadderRow], scaling: list[dict[str, Any] | None],
         answer: sizing.TargetAnswer | None) -> tuple[dict[str, Any], str]:
    """(JSON, text): ``ladder`` is sizing.ram_ladder's (without the NVMe, then with it), ``scaling`` each row's
    data-parallel figures (None for one GPU), ``answer`` sizing.least_ram_for's for the target."""
    model, work, hw, ranks = q.model, q.work, q.hw, q.ranks
    price = q.price_per_gb if q.price_per_gb is not None else DEFAULT_PRICE_PER_GB
    n = len(sizing.RAM_LADDER)
    rows, ladder_json = [], []
    for i, (plain, spill) in enumerate(zip(ladder[:n], ladder[n:])):
        row: list[object] = [gib(plain.ram_bytes)]
        for r, dp in ((plain, scaling[i]), (spill, scaling[n + i])):
            c = r.choice
            row += ([r.batch, rate(c.cost.tokens_per_second)] if c is not None and c.cost is not None
                    else ["-", "does not fit"])
            entry = {"ram_bytes": r.ram_bytes, "nvme": r.nvme, "batch": r.batch,
                     **(choice_json(c) if c is not None else {})}
            if ranks is not None:
                entry["data_parallel"] = dp
                row.append("-" if dp is None else f"{dp['efficiency']:.0%}")
            ladder_json.append(entry)
        c = spill.choice
        row += [gib(c.memory.nvme_bytes) if c is not None else "-"]
        rows.append(row)
    nvme_desc = _nvme_text(q)
    eff = ("efficiency",) if ranks is not None else ()
    heads = ("host RAM", "batch", "throughput", *eff, "+NVMe: batch", "throughput", *eff, "on NVMe")
    world = "" if ranks is None else f"{ranks.world} x "
    lines = [f"{model.name} ({model_shapes.params_label(model.params)} params) on {hw.gpu_name}, {work.seq_len} "
             f"tokens per sequence, {work.compute_dtype}: the largest batch ({world}a power of two, at most {q.max_batch}) that fits each RAM size, and its predicted throughput; with "
             f"{nvme_desc}"]
    if ranks is not None:
        lines.append(data_parallel_report.ram_heading(ranks))
    lines.append(table(heads, rows, (True,) * len(heads)))
    data: dict[str, Any] = {"params": model.params, "model": model.summary(), "seq_len": work.seq_len,
                            "compute_dtype": work.compute_dtype, "ladder": ladder_json,
                            "nvme": {"size_bytes": q.nvme_size, "read_gbps": hw.disk_read_gbps,
                                     "write_gbps": hw.disk_write_gbps, "speed_measured": q.disk_measured},
                            "price_per_gb": price, "price_assumed": q.price_per_gb is None,
                            "hardware": {"gpu_name": hw.gpu_name, "source": hw.source},
                            "host_ram_installed_bytes": hw.host_ram_bytes}
    if ranks is not None:
        data.update(gpus_per_node=ranks.gpus_per_node, nodes=ranks.nodes, world=ranks.world,
                    bandwidth=ranks.source, ram_per="node")
    if q.target is not None and answer is not None:
        lines.append("")
        lines += _target(q, answer, price, data)
    return data, "\n".join(lines)


def _nvme_text(q: RamQuestion) -> str:
    """The NVMe the with-NVMe figures assume: its size and speed, and where the speed comes from."""
    return f"a {gib(q.nvme_size)} NVMe at {disk_text(q.hw, q.disk_measured)}"


def _target(q: RamQuestion, ans: sizing.TargetAnswer, price: float, data: dict[str, Any]) -> list[str]:
    """The lines answering the throughput target; its figures added to ``data``."""
    model, hw, target, seq = q.model, q.hw, q.target, q.work.seq_len
    data["target_tokens_per_second"] = target
    data["reachable"] = ans.reachable
    lines = []
    if ans.reachable:
        options = [(label, o) for label, o in (("without NVMe", ans.without_nvme), ("with the NVMe", ans.with_nvme))
                   if o is not None]
        # The answer: the option needing the least host RAM.
        label, (batch, best) = min(options, key=lambda lo: lo[1][1].memory.host_bytes)
        need, to_buy = best.memory.host_bytes, buy(best.memory.host_bytes)
        assert best.cost is not None
        data.update(choice_json(best), batch=batch, ram_to_buy_bytes=to_buy, ram_cost=to_buy / 1e9 * price,
                    nvme_to_buy_bytes=best.memory.nvme_bytes, plan=best.plan.to_dict())
        for key, o in (("without_nvme", ans.without_nvme), ("with_nvme", ans.with_nvme)):
            data[key] = None if o is None else {"batch": o[0], **choice_json(o[1]),
                                                "ram_to_buy_bytes": buy(o[1].memory.host_bytes)}
        lines.append(f"least host RAM for >= {target:,.0f} tok/s (with the NVMe: {_nvme_text(q)}, at the "
                     f"table's RAM sizes):")
        for lab, (b, o) in options:
            assert o.cost is not None
            lines.append(f"  {lab}: batch {b} x {seq}, {rate(o.cost.tokens_per_second)} (MFU "
                         f"{o.cost.mfu:.0%}); the run needs {gib(o.memory.host_bytes)} "
                         f"({gib(o.memory.pinned_host_bytes)} pinned), {spill_text(o)}; buy "
                         f"{gib(buy(o.memory.host_bytes))}")
        lines += [f"buy {gib(to_buy)} ({label}; usable {sizing.USABLE_RAM_FRACTION:.0%}, in "
                  f"{gib(RAM_STEP_BYTES)} steps): {to_buy / 1e9:,.0f} GB x ${price:.2f}/GB = "
                  f"${to_buy / 1e9 * price:,.0f}" + (" (price assumed; pass --price-per-gb)"
                                                     if q.price_per_gb is None else ""),
                  f"this hardware has {gib(hw.host_ram_bytes)} RAM: "
                  + ("enough" if hw.host_budget_bytes >= need else "not enough")]
    elif ans.fastest is not None:
        batch, best = ans.fastest
        assert best.cost is not None
        bound = ans.bound(q.max_batch)
        data.update(choice_json(best), batch=batch, best_tokens_per_second=best.cost.tokens_per_second,
                    bound_by=bound, plan=best.plan.to_dict())
        lines.append(f"{target:,.0f} tok/s is out of reach for {model.name} on {hw.gpu_name}: the best is "
                     f"{rate(best.cost.tokens_per_second)} at batch {batch} x {seq} (the run needs "
                     f"{gib(best.memory.host_bytes)} host RAM, {spill_text(best)}), bound by {bound}; "
                     f"lower the target or pick faster --hardware")
    else:
        data["bound_by"] = "no plan fits"
        lines.append(f"{target:,.0f} tok/s is out of reach for {model.name} on {hw.gpu_name}: no plan fits at any "
                     f"batch (GPU memory); pick --hardware with more GPU memory or a shorter --seq-len")
    return lines
