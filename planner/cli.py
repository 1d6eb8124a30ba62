"""``megatrain-plan``: profile this machine, size hardware for a model, and choose the plan the runtime runs.

    megatrain-plan                       what this machine can train (every preset model)
    megatrain-plan profile               measure this machine into hardware.json
    megatrain-plan plan --model M ...    the chosen plan, its memory table, time breakdown, bottleneck
    megatrain-plan size --model M ...    minimum GPU / host / NVMe, and step time on each GPU preset
    megatrain-plan ram --model M ...     batch and throughput per RAM size, with and without an NVMe; the least
                                         RAM reaching a throughput target, and its cost

Each takes ``--json``. A bad name, file or budget prints one line on stderr and exits with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Sequence

from megatrain.errors import MegatrainError

from . import hardware as hwmod
from . import data_parallel, data_parallel_report, model_shapes, profiler, report, search, sizing, spill_placement
from .cli_args import PROG, CliError, Parser as _Parser, parse_size, positive_float as _positive_float, \
    positive_int as _positive_int
from .hardware import GiB, HardwareError, HardwareProfile
from .model_shapes import ModelShapeError
from .plan import PlanError
from .search import InfeasibleError, PlanChoice
from .workload import Workload, WorkloadError

# Assumed DDR5 RDIMM price when --price-per-gb is not given (USD per GB, 2025 street prices, rough).
DEFAULT_PRICE_PER_GB = 4.0
# RAM is bought in steps; round what a run needs up to a multiple of this.
RAM_STEP_BYTES = 32 * GiB
# NVMe size the purchase table (ram) assumes when --nvme-size is not given.
DEFAULT_NVME_SIZE = "4T"
# size and ram plan for hardware you may not have: their spill plans name this stand-in for its NVMe
# folder (not a directory; megatrain-train needs a real one, --spill-dir).
NVME_DIR = "<nvme>"


# ---- shared arguments -----------------------------------------------------------------------

def _hardware_args(p: argparse.ArgumentParser, default_help: str = "this machine") -> None:
    p.add_argument("--hardware", help=f"GPU preset ({', '.join(hwmod.GPU_PRESETS)}) or hardware.json "
                                      f"(default: {default_help})")
    p.add_argument("--host", help=f"host preset for a GPU preset ({', '.join(hwmod.HOST_PRESETS)})")
    p.add_argument("--ram", help="override host RAM, e.g. 512G or 1T")
    p.add_argument("--gpu-mem", help="override GPU memory, e.g. 80G")
    p.add_argument("--nvme", type=_positive_float, help="override NVMe read/write GB/s")


def _workload_args(p: argparse.ArgumentParser, need_batch: bool, sizing_only: bool = False) -> None:
    p.add_argument("--model", required=True, help=f"preset ({', '.join(model_shapes.PRESETS)}) or config.json")
    p.add_argument("--seq", type=_positive_int, default=None if need_batch else 4096,
                   required=need_batch, help="tokens per sequence")
    if need_batch:
        g = p.add_mutually_exclusive_group(required=True)
        g.add_argument("--batch", type=_positive_int, help="sequences per optimizer step")
        g.add_argument("--tokens-per-step", type=_positive_int, help="tokens per optimizer step (sets --batch)")
    p.add_argument("--dtype", default="auto", help="compute dtype: bf16, fp16, fp32, or auto (default: bf16 unless "
                                                   "the hardware multiplies fp32 faster)")
    p.add_argument("--no-clip", action="store_true",
                   help="no gradient clipping: lets the optimizer overlap backward (eager mode)")
    p.add_argument("--spill", choices=("auto", "none", "optimizer", "all"), default="auto",
                   help="what may live in spill files on disk: auto (the plan decides), none, optimizer (AdamW m, v), "
                        "all (fp32 master, m, v, grads)")
    if sizing_only:
        p.add_argument("--spill-dir", help=f"the spill folder the plans name (default {NVME_DIR}: the NVMe of "
                                           "the hardware being sized)")
    else:
        p.add_argument("--spill-dir", help="directory for spill files, on a fast local disk; without it nothing "
                                           "spills")


def _hardware(args: argparse.Namespace, default: str | None = None) -> HardwareProfile:
    name = args.hardware or default
    if name is None:
        if args.host:
            raise CliError("--host needs --hardware with a GPU preset; e.g. --hardware H100-SXM --host server-1t")
        hw = profiler.this_machine()
    else:
        hw = hwmod.resolve(name, args.host)
    return hw.with_overrides(
        ram_bytes=parse_size(args.ram, "--ram") if args.ram else None,
        gpu_mem_bytes=parse_size(args.gpu_mem, "--gpu-mem") if args.gpu_mem else None,
        nvme_gbps=args.nvme)


def _is_preset(args: argparse.Namespace) -> bool:
    return bool(args.hardware) and args.hardware.lower() in {k.lower() for k in hwmod.GPU_PRESETS}


def _dtype(args: argparse.Namespace, hw: HardwareProfile) -> str:
    """--dtype, or for auto the planner's choice for this hardware."""
    return search.preferred_compute_dtype(hw) if args.dtype == "auto" else args.dtype


def _free_bytes(directory: str | None) -> int | None:
    """Free bytes on the disk holding ``directory``; None when it is not a folder here (another machine's)."""
    if directory is None or not os.path.isdir(directory):
        return None
    return int(shutil.disk_usage(directory).free)


def _workload(args: argparse.Namespace, dtype: str, batch: int | None = None, spill_dir: str | None = None,
              free: int | None = None) -> Workload:
    if batch is None:
        batch = args.batch if args.batch else -(-args.tokens_per_step // args.seq)
    return Workload(args.seq, batch, dtype, clipping=not args.no_clip, spill=args.spill, spill_dir=spill_dir,
                    spill_free_bytes=free)


def _emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else text)


def _choice_json(c: PlanChoice) -> dict[str, Any]:
    assert c.cost is not None
    return {"gpu_bytes": c.memory.device_bytes, "host_ram_bytes": c.memory.host_bytes,
            "pinned_host_bytes": c.memory.pinned_host_bytes, "nvme_bytes": c.memory.nvme_bytes,
            "disk_traffic_bytes_per_step": search.disk_traffic_bytes(c.memory), "spill": c.plan.spill,
            "step_seconds": c.cost.step_seconds, "tokens_per_second": c.cost.tokens_per_second,
            "model_tflops": c.cost.model_tflops, "mfu": c.cost.mfu, "bottleneck": c.cost.bottleneck}


def _memory_json(c: PlanChoice) -> dict[str, Any]:
    """The memory side of a plan that was not timed."""
    return {"gpu_bytes": c.memory.device_bytes, "host_ram_bytes": c.memory.host_bytes,
            "pinned_host_bytes": c.memory.pinned_host_bytes, "nvme_bytes": c.memory.nvme_bytes,
            "disk_traffic_bytes_per_step": search.disk_traffic_bytes(c.memory), "spill": c.plan.spill}


def _spill_text(c: PlanChoice) -> str:
    """'nothing on disk' or 'spill all: 120 GiB on NVMe, 240 GiB disk traffic per step'."""
    if c.plan.spill == "none":
        return "nothing on disk"
    return (f"spills {spill_placement.label(c.plan)}: {report.gib(c.memory.nvme_bytes)} on disk, "
            f"{report.gib(search.disk_traffic_bytes(c.memory))} disk traffic per step")


def _disk_text(hw: HardwareProfile, measured: bool) -> str:
    how = "the hardware profile's figures" if measured else (
        "assumed, not measured: megatrain-plan profile --spill-dir DIR measures it, or pass --nvme GBPS")
    return f"read {hw.disk_read_gbps:.1f} / write {hw.disk_write_gbps:.1f} GB/s ({how})"


def _spill_hint(work: Workload, hw: HardwareProfile) -> str:
    """How spilling to disk could make an infeasible plan fit, when the command did not allow it."""
    if work.spill == "none":
        return ""
    if not work.spill_dir:
        return "; or let it spill to disk: --spill-dir DIR"
    if hw.disk_read_gbps <= 0 or hw.disk_write_gbps <= 0:
        return (f"; to spill to {work.spill_dir}, give the disk's speed: --nvme GBPS, or megatrain-plan profile "
                f"--spill-dir {work.spill_dir}")
    return ""


# ---- commands -------------------------------------------------------------------------------

def _longest_hint(model: model_shapes.ModelShape, work: Workload, hw: HardwareProfile) -> str:
    """For a sequence that does not fit: the longest one that does, at this batch."""
    seq = search.longest_context(model, hw, work.batch, work.compute_dtype, work.clipping,
                                 limit=max(work.seq_len - 1024, 1024), spill_dir=work.spill_dir,
                                 spill_free_bytes=work.spill_free_bytes)
    return f"; the longest sequence that fits is {seq:,} tokens (--seq {seq})" if seq else ""


def cmd_plan(args: argparse.Namespace) -> None:
    model = model_shapes.resolve(args.model)
    hw = _hardware(args)
    work = _workload(args, _dtype(args, hw), spill_dir=args.spill_dir, free=_free_bytes(args.spill_dir))
    ranks = data_parallel_report.topology_of(args, hw)  # several GPUs: the plan of one rank, on its share
    result = search.search(model, work, hw, ranks)
    try:
        best = result.require()
    except InfeasibleError as e:
        disk_full = any(o.budget == "NVMe" for o in result.overruns)
        raise InfeasibleError(f"{e}{'; or a --spill-dir with more free space' if disk_full else _spill_hint(work, hw)}"
                              f"{_longest_hint(model, work, hw)}") from None
    assert best.cost is not None
    if args.out:
        best.plan.save(args.out)
    data = {"params": model.params, "model": model.summary(), **_choice_json(best),
            "plan": best.plan.to_dict(), "memory": best.memory.rows(), "time": best.cost.to_dict(),
            "workload": {"seq_len": work.seq_len, "batch": work.batch, "tokens": work.tokens,
                         "compute_dtype": work.compute_dtype, "clipping": work.clipping, "spill": work.spill},
            "disk": {"spill_dir": work.spill_dir, "free_bytes": work.spill_free_bytes,
                     "read_gbps": hw.disk_read_gbps, "write_gbps": hw.disk_write_gbps},
            "hardware": {"gpu_name": hw.gpu_name, "source": hw.source}, "plans_considered": result.considered}
    c, p = best.cost, best.plan
    share = work if ranks is None else data_parallel.rank_workload(work, ranks)   # one rank's batch
    if p.spill != "none":
        free = f", {report.gib(work.spill_free_bytes)} free" if work.spill_free_bytes is not None else ""
        spill = (f"spill: {_spill_text(best)}, in {p.spill_dir} (read {hw.disk_read_gbps:.1f} / write "
                 f"{hw.disk_write_gbps:.1f} GB/s{free})")
    else:
        spill = "spill: nothing on disk" + ("" if work.spill_dir or work.spill == "none"
                                            else " (pass --spill-dir DIR to allow it)")
    text = "\n".join([
        f"{model.name} ({model_shapes.params_label(model.params)} params), {work.batch} x {work.seq_len} tokens "
        f"per step, {work.compute_dtype}, clipping {'on' if work.clipping else 'off'}",
        f"hardware: {report.hardware_line(hw)}",
        f"  source: {hw.source}", "",
        f"plan: {p.micro_batch_size} sequences x {share.micro_batches(p.micro_batch_size)} micro-batches, "
        f"{p.num_slots} slots (prefetch {p.prefetch_depth}), checkpoints on {p.checkpoints}"
        f"{f' (copied in pieces of {p.checkpoint_piece_tokens} tokens)' if p.checkpoint_piece_tokens else ''}, "
        f"optimizer {p.optimizer_mode}, loss chunk {p.loss_chunk_tokens} tokens"
        + (f", MLP tiles of {p.mlp_tile_tokens} tokens" if p.mlp_tile_tokens else "")
        + (f", attention projection tiles of {p.attention_tile_tokens} tokens" if p.attention_tile_tokens else "")
        + (f", saved to {args.out}" if args.out else ""), spill, "",
        report.memory_table(best.memory), "",
        report.time_table(c), "",
        f"step {report.seconds(c.step_seconds)}, {report.rate(c.tokens_per_second)}, model {c.model_tflops:.0f} "
        f"TFLOP/s without attention (6N per token), {report.with_attention_tflops(c):.0f} with attention FLOPs, "
        f"MFU {c.mfu:.1%}; bottleneck: {c.bottleneck}; "
        f"{report.seconds(1e9 / c.tokens_per_second)} per billion tokens",
    ])
    if ranks is not None:
        data["data_parallel"], more = data_parallel_report.section(model, work, p, hw, ranks)
        text += "\n\n" + more
    _emit(args, data, text)


def cmd_size(args: argparse.Namespace) -> None:
    model = model_shapes.resolve(args.model)
    probe = hwmod.preset("H100-SXM")
    work = _workload(args, _dtype(args, probe), spill_dir=args.spill_dir or NVME_DIR)
    G = args.gpus_per_node
    least = search.minimum_memory(model, work, probe, data_parallel_report.checked_topology(args, work, probe))
    host, gpu, resident = least["host"], least["gpu"], least.get("host_no_spill")
    per_hw: list[dict[str, Any]] = []
    rows = []
    for name in hwmod.GPU_PRESETS:
        hw = hwmod.preset(name, args.host).with_overrides(
            ram_bytes=parse_size(args.ram, "--ram") if args.ram else None, nvme_gbps=args.nvme)
        ranks = data_parallel_report.checked_topology(args, work, hw)
        r = search.search(model, work, hw, ranks)
        entry: dict[str, Any] = {"hardware": name, "feasible": r.feasible, "reason": r.reason(),
                                 "host_ram_available_bytes": hw.host_budget_bytes,
                                 "disk_read_gbps": hw.disk_read_gbps, "disk_write_gbps": hw.disk_write_gbps}
        if r.best is not None:
            entry.update(_choice_json(r.best))
            c, m = r.best.cost, r.best.memory
            assert c is not None
            step, rate, last, bound = c.step_seconds, c.tokens_per_second, f"{c.mfu:.0%}", c.bottleneck
            if ranks is not None:
                entry["data_parallel"] = dp = data_parallel_report.figures(model, work, r.best.plan, hw, ranks)
                step, rate, last = dp["step_seconds"], dp["tokens_per_second"], f"{dp['efficiency']:.0%}"
                bound = "collectives" if dp["collectives_bound"] else bound
            rows.append((name, report.gib(hw.host_budget_bytes), report.gib(G * m.host_bytes),
                         report.gib(G * m.nvme_bytes), report.gib(G * search.disk_traffic_bytes(m)))
                        + ((report.gib(m.device_bytes),) if ranks is not None else ())
                        + (report.seconds(step), report.rate(rate), last, bound))
        else:
            rows.append((name, report.gib(hw.host_budget_bytes)) + ("-",) * (7 if G * args.nodes > 1 else 6)
                        + (r.reason(),))
        per_hw.append(entry)
    rate_of = (lambda e: e["data_parallel"]["step_seconds"]) if G * args.nodes > 1 else (lambda e: e["step_seconds"])
    fastest = min((e for e in per_hw if e["feasible"]), key=rate_of, default=None)
    figures = fastest.get("data_parallel", fastest) if fastest else None
    data = {"params": model.params, "model": model.summary(),
            "workload": {"seq_len": work.seq_len, "batch": work.batch, "compute_dtype": work.compute_dtype,
                         "clipping": work.clipping, "spill": work.spill},
            "gpu_bytes": gpu.memory.device_bytes, **{k: v for k, v in _memory_json(host).items() if k != "gpu_bytes"},
            "host_ram_no_spill_bytes": resident.memory.host_bytes if resident else None,
            "step_seconds": figures["step_seconds"] if figures else None,
            "tokens_per_second": figures["tokens_per_second"] if figures else None,
            "fastest_hardware": fastest["hardware"] if fastest else None, "hardware": per_hw}
    ranks_line = []
    if G * args.nodes > 1:
        data.update(gpus_per_node=G, nodes=args.nodes, world=G * args.nodes,
                    node_host_ram_bytes=G * host.memory.host_bytes, node_nvme_bytes=G * host.memory.nvme_bytes,
                    node_host_ram_no_spill_bytes=G * resident.memory.host_bytes if resident else None,
                    efficiency=figures["efficiency"] if figures else None)
        ranks_line = [f"data parallel: {G * args.nodes} ranks ({G} per node x {args.nodes} node"
                      f"{'s' if args.nodes > 1 else ''}), {work.batch // (G * args.nodes)} sequences per rank; "
                      f"GPU memory per GPU, host RAM and NVMe per node ({G} ranks: their shards and each one's "
                      f"buffers); step and throughput of all ranks with the collectives; efficiency against one GPU "
                      f"on the same global batch"]
    least_line = (f"minimum host RAM {report.gib(G * host.memory.host_bytes)}{' per node' if ranks_line else ''} with "
                  + ("nothing on disk" if host.plan.spill == "none" else
                     f"{report.gib(G * host.memory.nvme_bytes)} on NVMe ({spill_placement.label(host.plan)} spilled, "
                     f"{report.gib(G * search.disk_traffic_bytes(host.memory))} disk traffic per step)"))
    if resident is not None and resident is not host:
        least_line += f"; without NVMe {report.gib(G * resident.memory.host_bytes)}"
    node = " per node" if ranks_line else ""
    heads = (("GPU preset", f"host RAM{node}", "run needs", "NVMe", "disk/step") + (("per GPU",) if ranks_line else ())
             + ("step", "throughput", "efficiency" if ranks_line else "MFU", "bound by / why not"))
    text = "\n".join([
        f"{model.name} ({model_shapes.params_label(model.params)} params), {work.batch} x {work.seq_len} tokens "
        f"per step, {work.compute_dtype}, clipping {'on' if work.clipping else 'off'}, spill {work.spill}",
        *ranks_line,
        f"minimum GPU memory {report.gib(gpu.memory.device_bytes)} (plan: {gpu.plan.micro_batch_size} seq "
        f"per micro-batch, checkpoints on {gpu.plan.checkpoints})", least_line, "",
        report.table(heads, rows, (False,) + (True,) * (len(heads) - 2) + (False,)),
        f"(each preset with its usual host and that host's NVMe; spill plans write to {work.spill_dir})",
    ])
    _emit(args, data, text)


def _buy(need: int) -> int:
    """Installed RAM to buy for a run needing ``need`` bytes: usable share, whole RAM_STEP_BYTES steps."""
    return math.ceil(need / sizing.USABLE_RAM_FRACTION / RAM_STEP_BYTES) * RAM_STEP_BYTES


def cmd_ram(args: argparse.Namespace) -> None:
    model = model_shapes.resolve(args.model)
    hw, measured = sizing.with_disk(_hardware(args))
    nvme_size = parse_size(args.nvme_size, "--nvme-size")
    work = Workload(args.seq, 1, _dtype(args, hw), clipping=not args.no_clip, spill=args.spill,
                    spill_dir=args.spill_dir or NVME_DIR, spill_free_bytes=nvme_size)
    price = args.price_per_gb if args.price_per_gb is not None else DEFAULT_PRICE_PER_GB
    ranks = data_parallel_report.checked_topology(args, dataclasses.replace(work, batch=args.gpus_per_node * args.nodes),
                                                  hw)
    ladder = sizing.ram_ladder(model, work, hw, args.max_batch, ranks=ranks)
    n = len(sizing.RAM_LADDER)
    rows, ladder_json = [], []
    for plain, spill in zip(ladder[:n], ladder[n:]):
        row: list[object] = [report.gib(plain.ram_bytes)]
        for r in (plain, spill):
            c = r.choice
            row += ([r.batch, report.rate(c.cost.tokens_per_second)] if c is not None and c.cost is not None
                    else ["-", "does not fit"])
            entry = {"ram_bytes": r.ram_bytes, "nvme": r.nvme, "batch": r.batch,
                     **(_choice_json(c) if c is not None else {})}
            if ranks is not None:
                entry["data_parallel"] = dp = (None if c is None else data_parallel_report.figures(
                    model, dataclasses.replace(work, batch=r.batch), c.plan, sizing.with_ram(hw, r.ram_bytes), ranks))
                row.append("-" if dp is None else f"{dp['efficiency']:.0%}")
            ladder_json.append(entry)
        c = spill.choice
        row += [report.gib(c.memory.nvme_bytes) if c is not None else "-"]
        rows.append(row)
    nvme_desc = (f"a {report.gib(nvme_size)} NVMe at {_disk_text(hw, measured)}")
    eff = ("efficiency",) if ranks is not None else ()
    heads = ("host RAM", "batch", "throughput", *eff, "+NVMe: batch", "throughput", *eff, "on NVMe")
    lines = [f"{model.name} ({model_shapes.params_label(model.params)} params) on {hw.gpu_name}, {args.seq} tokens per "
             f"sequence, {work.compute_dtype}: the largest batch ({'' if ranks is None else f'{ranks.world} x '}a "
             f"power of two, "
             f"at most {args.max_batch}) that fits each RAM size, and its predicted throughput; with {nvme_desc}"]
    if ranks is not None:
        lines.append(data_parallel_report.ram_heading(ranks))
    lines.append(report.table(heads, rows, (True,) * len(heads)))
    data: dict[str, Any] = {"params": model.params, "model": model.summary(), "seq_len": args.seq,
                            "compute_dtype": work.compute_dtype, "ladder": ladder_json,
                            "nvme": {"size_bytes": nvme_size, "read_gbps": hw.disk_read_gbps,
                                     "write_gbps": hw.disk_write_gbps, "speed_measured": measured},
                            "price_per_gb": price, "price_assumed": args.price_per_gb is None,
                            "hardware": {"gpu_name": hw.gpu_name, "source": hw.source},
                            "host_ram_installed_bytes": hw.host_ram_bytes}
    if ranks is not None:
        data.update(gpus_per_node=ranks.gpus_per_node, nodes=ranks.nodes, world=ranks.world,
                    bandwidth=ranks.source, ram_per="node")
    target = args.tokens_per_second
    if target is not None:
        ans = sizing.least_ram_for(model, work, hw, target, args.max_batch, ranks)
        data["target_tokens_per_second"] = target
        data["reachable"] = ans.reachable
        lines.append("")
        if ans.reachable:
            options = [(label, o) for label, o in (("without NVMe", ans.without_nvme), ("with the NVMe", ans.with_nvme))
                       if o is not None]
            # The answer: the option needing the least host RAM.
            label, (batch, best) = min(options, key=lambda lo: lo[1][1].memory.host_bytes)
            need, buy = best.memory.host_bytes, _buy(best.memory.host_bytes)
            assert best.cost is not None
            data.update(_choice_json(best), batch=batch, ram_to_buy_bytes=buy, ram_cost=buy / 1e9 * price,
                        nvme_to_buy_bytes=best.memory.nvme_bytes, plan=best.plan.to_dict())
            for key, o in (("without_nvme", ans.without_nvme), ("with_nvme", ans.with_nvme)):
                data[key] = None if o is None else {"batch": o[0], **_choice_json(o[1]),
                                                    "ram_to_buy_bytes": _buy(o[1].memory.host_bytes)}
            lines.append(f"least host RAM for >= {target:,.0f} tok/s:")
            for lab, (b, o) in options:
                assert o.cost is not None
                if lab == "with the NVMe" and o.plan.spill == "none":
                    lines.append(f"  {lab}: no less RAM (the plans that spill are slower than the target)")
                    continue
                lines.append(f"  {lab}: batch {b} x {args.seq}, {report.rate(o.cost.tokens_per_second)} (MFU "
                             f"{o.cost.mfu:.0%}); the run needs {report.gib(o.memory.host_bytes)} "
                             f"({report.gib(o.memory.pinned_host_bytes)} pinned), {_spill_text(o)}; buy "
                             f"{report.gib(_buy(o.memory.host_bytes))}")
            lines += [f"buy {report.gib(buy)} ({label}; usable {sizing.USABLE_RAM_FRACTION:.0%}, in "
                      f"{report.gib(RAM_STEP_BYTES)} steps): {buy / 1e9:,.0f} GB x ${price:.2f}/GB = "
                      f"${buy / 1e9 * price:,.0f}" + (" (price assumed; pass --price-per-gb)"
                                                      if args.price_per_gb is None else ""),
                      f"this hardware has {report.gib(hw.host_ram_bytes)} RAM: "
                      + ("enough" if hw.host_budget_bytes >= need else "not enough")]
        elif ans.fastest is not None:
            batch, best = ans.fastest
            assert best.cost is not None
            bound = ans.bound(args.max_batch)
            data.update(_choice_json(best), batch=batch, best_tokens_per_second=best.cost.tokens_per_second,
                        bound_by=bound, plan=best.plan.to_dict())
            lines.append(f"{target:,.0f} tok/s is out of reach for {model.name} on {hw.gpu_name}: the best is "
                         f"{report.rate(best.cost.tokens_per_second)} at batch {batch} x {args.seq} (the run needs "
                         f"{report.gib(best.memory.host_bytes)} host RAM, {_spill_text(best)}), bound by {bound}; "
                         f"lower the target or pick faster --hardware")
        else:
            data["bound_by"] = "no plan fits"
            lines.append(f"{target:,.0f} tok/s is out of reach for {model.name} on {hw.gpu_name}: no plan fits at any "
                         f"batch (GPU memory); pick --hardware with more GPU memory or a shorter --seq")
    _emit(args, data, "\n".join(lines))


def _check_writable(path: str) -> None:
    """Refuse, before measuring, a destination that cannot be written: make its folder and write a scratch
    file there (removed at once); an existing file is left as it is."""
    if os.path.isdir(path):
        raise CliError(f"--out={path!r} is a directory; name a file, e.g. {os.path.join(path, 'hardware.json')}")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        fd, scratch = tempfile.mkstemp(prefix=".megatrain-write-check-", dir=folder)
        os.close(fd)
        os.unlink(scratch)
    except OSError as e:
        raise CliError(f"--out={path!r} cannot be written ({e.strerror} in {folder}); pass --out in a folder you "
                       f"can write") from None
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise CliError(f"--out={path!r} exists and is not writable; pass another --out")


def cmd_profile(args: argparse.Namespace) -> None:
    if args.spill_dir and not os.path.isdir(args.spill_dir):
        raise CliError(f"--spill-dir={args.spill_dir!r} is not a directory; pass an existing folder on the NVMe")
    out = args.out or profiler.CACHE_PATH
    _check_writable(out)
    log = (lambda s: None) if args.json else (lambda s: print(f"measuring: {s}", file=sys.stderr))
    hw = profiler.measure(args.spill_dir, log=log)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    hw.save(out)
    text = report.profile_text(hw, out)
    _emit(args, {**hw.to_dict(), "saved_to": out}, text)


def cmd_overview(args: argparse.Namespace) -> None:
    base = _hardware(args)
    preset = _is_preset(args)
    spill_dir = os.path.abspath(args.spill_dir or os.getcwd())
    if not preset and not os.path.isdir(spill_dir):
        raise CliError(f"--spill-dir={args.spill_dir!r} is not a directory; pass an existing folder on a fast disk")
    # This machine: the disk under the spill folder, its free space measured now. A preset: its NVMe, any size.
    free = None if preset else _free_bytes(spill_dir)
    hw, measured = sizing.with_disk(base)
    dtype = _dtype(args, hw)
    batches = (args.batch,) if args.batch else sizing.OVERVIEW_BATCHES
    work = Workload(args.seq, max(batches), dtype, clipping=not args.no_clip, spill_dir=spill_dir,
                    spill_free_bytes=free)
    rows, entries = [], []
    on_gpu = not hw.device_is_host
    for name, model in model_shapes.PRESETS.items():
        a = sizing.what_fits(model, work, hw, batches)
        e: dict[str, Any] = {"model": name, "params": model.params, "feasible": a.choice is not None,
                             "fits": a.fits, "batch": a.batch, "reason": a.reason,
                             "spill_cost_seconds": a.spill_cost_seconds, "longest_context_batch1": a.longest_context}
        label = model_shapes.params_label(model.params)
        ctx = str(a.longest_context) if a.longest_context else "-"
        if a.choice is not None and a.choice.cost is not None:
            e.update(_choice_json(a.choice))
            c, m = a.choice.cost, a.choice.memory
            spill_cost = "-" if a.fits == "ram" else f"+{report.seconds(a.spill_cost_seconds)}"
            rows.append((name, label, {"ram": "in RAM", "spill": "with spill"}[a.fits], a.batch,
                         report.seconds(c.step_seconds), report.rate(c.tokens_per_second),
                         # without a GPU the "device" buffers live in host RAM too
                         report.gib(m.host_bytes + (0 if on_gpu else m.device_bytes)))
                        + ((report.gib(m.device_bytes),) if on_gpu else ())
                        + (report.gib(m.nvme_bytes), spill_cost, ctx))
        else:
            rows.append((name, label, "no", "-", "-", "-", "-") + (("-",) if on_gpu else ()) + ("-", "-", ctx))
        entries.append(e)
    ok = [e for e in entries if e["feasible"]]
    largest = max(ok, key=lambda e: e["params"], default=None)
    largest_ram = max((e for e in ok if e["fits"] == "ram"), key=lambda e: e["params"], default=None)
    longest = max(entries, key=lambda e: e["longest_context_batch1"])
    # The largest Llama-shaped model for the RAM and the disk's free space together (a preset's disk: any size).
    big = None if free is None else sizing.largest_llama(dataclasses.replace(work, batch=1), hw)
    disk = {"spill_dir": spill_dir if not preset else None, "free_bytes": free, "read_gbps": hw.disk_read_gbps,
            "write_gbps": hw.disk_write_gbps, "speed_measured": measured}
    data = {"hardware": {"gpu_name": hw.gpu_name, "source": hw.source}, "seq_len": args.seq,
            "batch": args.batch if args.batch else "auto", "compute_dtype": dtype, "disk": disk, "models": entries,
            "largest_model": largest["model"] if largest else None,
            "largest_model_in_ram": largest_ram["model"] if largest_ram else None,
            "longest_context": {"model": longest["model"], "seq_len": longest["longest_context_batch1"]},
            "largest_llama": None if big is None else big.to_dict()}
    rates = hw.matmul_tflops
    why = (f" (auto: this hardware multiplies fp32 faster than bf16, {rates.get('float32', 0):.3g} vs "
           f"{rates.get('bfloat16', 0):.3g} TFLOP/s)" if args.dtype == "auto" and dtype == "float32" else "")
    where = (f"{spill_dir}, {report.gib(free)} free" if free is not None else f"{hw.gpu_name}'s host NVMe, any size")
    lines = [f"{'this machine' if not preset else 'hardware'}: {report.hardware_line(hw)}",
             f"  source: {hw.source}",
             f"spill disk: {where}; {_disk_text(hw, measured)}",
             f"compute dtype: {dtype}{why}", "",
             f"each preset model at {'up to ' if not args.batch else ''}{max(batches)} x {args.seq} tokens per step"
             + (" (the largest batch of " + ", ".join(map(str, batches)) + " that fits)" if not args.batch else "")
             + ":",
             report.table(("model", "params", "fits", "batch", "step", "throughput", "host RAM")
                          + (("GPU mem",) if on_gpu else ()) + ("NVMe", "spill cost", "max seq (batch 1)"), rows,
                          (False, True, False, True, True, True, True) + ((True,) if on_gpu else ())
                          + (True, True, True)),
             "",
             f"largest model it can train: {largest['model'] if largest else 'none of the presets'}"
             + (" (with spill)" if largest and largest["fits"] == "spill" else "")
             + (f"; in RAM alone: {largest_ram['model']}" if largest_ram and largest_ram is not largest else "")
             + f"; longest context: {longest['longest_context_batch1']} tokens ({longest['model']}, batch 1)"]
    lines += [] if big is None else [big.line() + f" (batch 1 x {args.seq} tokens)"]
    for e in entries:
        if not e["feasible"]:
            lines.append(f"  {e['model']}: {e['reason']}")
    _emit(args, data, "\n".join(lines))


# ---- entry point ----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Profile this machine, size hardware for a model, and choose the plan "
                                       "megatrain runs. With no command: what this machine can train.")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--seq", type=_positive_int, default=4096, help="overview: tokens per sequence (4096)")
    p.add_argument("--batch", type=_positive_int, default=None,
                   help="overview: sequences per step (default: the largest of 16, 8, 4, 2, 1 that fits)")
    p.add_argument("--dtype", default="auto", help="overview: compute dtype (default auto: bf16 unless the hardware "
                                                   "multiplies fp32 faster)")
    p.add_argument("--no-clip", action="store_true", help="overview: no gradient clipping")
    p.add_argument("--spill-dir", help="overview: where spill files would go (default: the current directory)")
    _hardware_args(p)
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="{profile,calibrate,plan,size,ram}")

    sp = sub.add_parser("profile", help="measure this machine into hardware.json")
    sp.add_argument("--out", help=f"where to write it (default {profiler.CACHE_PATH}, which other commands read)")
    sp.add_argument("--spill-dir", help="measure disk read/write GB/s in this folder")
    sp.add_argument("--json", action="store_true", help="print JSON for scripts")

    # Runs the runtime, which the planner never imports: main() hands it to its own process.
    sub.add_parser("calibrate", add_help=False, help="fit the cost and memory constants from real training steps "
                                                     "on this machine (--help for its options)")

    sp = sub.add_parser("plan", help="choose the plan for a model, sequence and batch")
    _workload_args(sp, need_batch=True)
    _hardware_args(sp)
    sp.add_argument("--out", help="write the plan JSON the runtime executes")
    data_parallel_report.add_arguments(sp, _positive_int, _positive_float)
    sp.add_argument("--json", action="store_true", help="print JSON for scripts")

    sp = sub.add_parser("size", help="minimum memory, and step time on each GPU preset")
    _workload_args(sp, need_batch=True, sizing_only=True)
    sp.add_argument("--host", help=f"host preset for every GPU ({', '.join(hwmod.HOST_PRESETS)}); "
                                   "default: each GPU's usual host")
    sp.add_argument("--ram", help="override host RAM on every preset, e.g. 1T")
    sp.add_argument("--nvme", type=_positive_float, help="override the NVMe read/write GB/s on every preset")
    data_parallel_report.add_arguments(sp, _positive_int, _positive_float)
    sp.add_argument("--json", action="store_true", help="print JSON for scripts")

    sp = sub.add_parser("ram", help="how much host RAM (and NVMe) to buy: batch and throughput per RAM size, "
                                    "and the least RAM for a throughput target")
    _workload_args(sp, need_batch=False, sizing_only=True)
    sp.add_argument("--tokens-per-second", type=_positive_float, help="throughput target (optional)")
    sp.add_argument("--nvme-size", default=DEFAULT_NVME_SIZE,
                    help=f"NVMe size of the with-NVMe columns (default {DEFAULT_NVME_SIZE}); its speed: --nvme GB/s, "
                         "else the hardware's, else an assumed figure")
    sp.add_argument("--price-per-gb", type=_positive_float, help=f"USD per GB (default {DEFAULT_PRICE_PER_GB}, "
                                                                 "an assumption)")
    sp.add_argument("--max-batch", type=_positive_int, default=4096, help="largest batch to try (4096)")
    _hardware_args(sp)
    data_parallel_report.add_arguments(sp, _positive_int, _positive_float)
    sp.add_argument("--json", action="store_true", help="print JSON for scripts")
    return p


COMMANDS = {"plan": cmd_plan, "size": cmd_size, "ram": cmd_ram, "profile": cmd_profile, None: cmd_overview}
USER_ERRORS = (MegatrainError,)  # every error a user can fix: PlanError, HardwareError, ... derive from it


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:  # tools/calibrate.py drives the runtime; the planner only reads its result
        return subprocess.call([sys.executable, "-m", "megatrain.tools.calibrate", *argv[1:]])
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except USER_ERRORS as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into head & co: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
