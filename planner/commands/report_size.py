"""What ``megatrain-plan size`` prints: the minimum memory to buy, and a row per GPU preset (its plan's host RAM,
NVMe, step, throughput and bound), as text and as JSON. Pure stdlib; formatting only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatrain.planner.shapes import model_shapes
from megatrain.planner.commands import report_ram
from megatrain.planner.costs import spill_placement
from megatrain.planner.commands.cli_args import NVME_DIR
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.planner.commands.report import choice_json, gib, memory_json, rate, seconds, table
from megatrain.planner.choice.search import PlanChoice, SearchResult
from megatrain.planner.shapes.workload import Workload


@dataclass(frozen=True)
class Preset:
    """One GPU preset's answer."""

    name: str
    hw: HardwareProfile
    result: SearchResult
    data_parallel: dict[str, Any] | None   # data_parallel_report.figures with ranks; None for one GPU


def page(model: ModelShape, work: Workload, least: dict[str, PlanChoice], presets: list[Preset],
         G: int, nodes: int) -> tuple[dict[str, Any], str]:
    """(JSON, text) of ``size``: ``least`` is search.minimum_memory's, ``G`` GPUs per node."""
    host, gpu, resident = least["host"], least["gpu"], least.get("host_no_spill")
    many = G * nodes > 1
    per_hw, rows = [], []
    for p in presets:
        r, hw = p.result, p.hw
        entry: dict[str, Any] = {"hardware": p.name, "feasible": r.feasible, "reason": r.reason(),
                                 "host_ram_available_bytes": hw.host_budget_bytes,
                                 "disk_read_gbps": hw.disk_read_gbps, "disk_write_gbps": hw.disk_write_gbps}
        if r.best is not None:
            entry.update(choice_json(r.best))
            c, m = r.best.cost, r.best.memory
            assert c is not None
            step, speed, last, bound = c.step_seconds, c.tokens_per_second, f"{c.mfu:.0%}", c.bottleneck
            if p.data_parallel is not None:
                entry["data_parallel"] = dp = p.data_parallel
                step, speed, last = dp["step_seconds"], dp["tokens_per_second"], f"{dp['efficiency']:.0%}"
                bound = "collectives" if dp["collectives_bound"] else bound
            rows.append((p.name, gib(hw.host_budget_bytes), gib(G * m.host_bytes),
                         gib(G * m.nvme_bytes), gib(G * spill_placement.disk_traffic_bytes(m.nvme_bytes)))
                        + ((gib(m.device_bytes),) if many else ())
                        + (seconds(step), rate(speed), last, bound))
        else:
            rows.append((p.name, gib(hw.host_budget_bytes)) + ("-",) * (7 if many else 6) + (r.reason(),))
        per_hw.append(entry)
    rate_of = (lambda e: e["data_parallel"]["step_seconds"]) if many else (lambda e: e["step_seconds"])
    fastest = min((e for e in per_hw if e["feasible"]), key=rate_of, default=None)
    figures = fastest.get("data_parallel", fastest) if fastest else None
    data = {"params": model.params, "model": model.summary(),
            "workload": {"seq_len": work.seq_len, "batch": work.batch, "compute_dtype": work.compute_dtype,
                         "clipping": work.clipping, "spill": work.spill, "optimizer_state": work.optimizer_state},
            "gpu_bytes": gpu.memory.device_bytes, **{k: v for k, v in memory_json(host).items() if k != "gpu_bytes"},
            "host_ram_no_spill_bytes": resident.memory.host_bytes if resident else None,
            "step_seconds": figures["step_seconds"] if figures else None,
            "tokens_per_second": figures["tokens_per_second"] if figures else None,
            "fastest_hardware": fastest["hardware"] if fastest else None, "hardware": per_hw}
    ranks_line = []
    if many:
        data.update(gpus_per_node=G, nodes=nodes, world=G * nodes,
                    node_host_ram_bytes=G * host.memory.host_bytes, node_nvme_bytes=G * host.memory.nvme_bytes,
                    node_host_ram_no_spill_bytes=G * resident.memory.host_bytes if resident else None,
                    efficiency=figures["efficiency"] if figures else None)
        ranks_line = [f"data parallel: {G * nodes} ranks ({G} per node x {nodes} node"
                      f"{'s' if nodes > 1 else ''}), {work.batch // (G * nodes)} sequences per rank; "
                      f"GPU memory per GPU, host RAM and NVMe per node ({G} ranks: their shards and each one's "
                      f"buffers); step and throughput of all ranks with the collectives; efficiency against one GPU "
                      f"on the same global batch"]
    least_line = (f"minimum host RAM {gib(G * host.memory.host_bytes)}{' per node' if ranks_line else ''} with "
                  + ("nothing on disk" if host.plan.spill == "none" else
                     f"{gib(G * host.memory.nvme_bytes)} on NVMe ({spill_placement.label(host.plan)} spilled, "
                     f"{gib(G * spill_placement.disk_traffic_bytes(host.memory.nvme_bytes))} disk traffic per step)"))
    if resident is not None and resident is not host:
        least_line += f"; without NVMe {gib(G * resident.memory.host_bytes)}"
    node = " per node" if ranks_line else ""
    heads = (("GPU preset", f"host RAM{node}", "run needs", "NVMe", "disk/step") + (("per GPU",) if ranks_line else ())
             + ("step", "throughput", "efficiency" if ranks_line else "MFU", "bound by / why not"))
    text = "\n".join([
        f"{model.name} ({model_shapes.params_label(model.params)} params), {work.batch} x {work.seq_len} tokens "
        f"per step, {work.compute_dtype}, clipping {'on' if work.clipping else 'off'}, spill {work.spill}",
        *verdicts(presets, least, G, node), state_line(model, work), *ranks_line,
        f"minimum GPU memory {gib(gpu.memory.device_bytes)} (plan: {gpu.plan.micro_batch_size} seq "
        f"per micro-batch, checkpoints on {gpu.plan.checkpoints})", least_line, "",
        table(heads, rows, (False,) + (True,) * (len(heads) - 2) + (False,)),
        "(GPU presets' figures, not measured: each preset with its usual host and that host's NVMe at the preset's "
        "speed, any size; `megatrain-plan profile` then `megatrain-plan plan` size this machine; "
        + ("--spill-dir DIR sizes against that folder's free space)" if work.spill_dir == NVME_DIR else
           f"spill plans write to {work.spill_dir})"),
    ])
    return data, text


def verdicts(presets: list[Preset], least: dict[str, PlanChoice], G: int, node: str) -> list[str]:
    """A line per configuration: fits in RAM / fits with N GiB on NVMe / does not fit, and what would make it fit
    (``least``: search.minimum_memory's, on a probe GPU: the least the model needs anywhere)."""
    host, resident, gpu = least["host"].memory, least.get("host_no_spill"), least["gpu"].memory
    lines = []
    for p in presets:
        hw, best = p.hw, p.result.best
        ram = f"the {gib(hw.host_budget_bytes)} of RAM usable{node}"
        if best is not None:
            m = best.memory
            lines.append(f"{p.name}: fits in RAM: the run needs {gib(G * m.host_bytes)} of {ram}, nothing on NVMe"
                         if best.plan.spill == "none" else
                         f"{p.name}: fits with {gib(G * m.nvme_bytes)} on NVMe: the run needs {gib(G * m.host_bytes)} "
                         f"of {ram}" + (f"; in RAM alone it needs {gib(G * resident.memory.host_bytes)}"
                                        if resident is not None else ""))
            continue
        if gpu.device_bytes > hw.gpu_mem_bytes:
            fix = f"a GPU with at least {gib(gpu.device_bytes)} (or a shorter --seq-len)"
        elif G * host.host_bytes > hw.host_budget_bytes:
            fix = (f"at least {gib(report_ram.buy(G * host.host_bytes))} of RAM{node} with "
                   f"{gib(G * host.nvme_bytes)} on NVMe (--ram; `megatrain-plan ram` prices it)")
        else:
            fix = "more free NVMe space (--spill-dir on a larger disk) or a smaller --batch"
        lines.append(f"{p.name}: does not fit ({p.result.reason()}); it would fit with {fix}")
    return lines


def state_line(model: ModelShape, work: Workload) -> str:
    """The host state per parameter the AdamW state dtype implies, and what bf16 saves against fp32."""
    per = 4 + 2 * work.state_bytes
    saved = 2 * (4 - work.state_bytes) * model.numel_total
    return (f"AdamW state {work.optimizer_state}: {per} bytes/param of host state with the fp32 master"
            + (f" (fp32 state: 12; {gib(saved)} less)" if saved else " (bf16 state: 8, --optimizer-state bf16)"))
