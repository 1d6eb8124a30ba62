"""What megatrain-plan's commands print, shared by all of them: units a person reads at a glance, aligned
tables, a plan's figures as text and as JSON. Each command's own page is in its report_* module.

Pure stdlib; no numbers are computed here, only formatted.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from megatrain.planner.costs import data_parallel, resident_blocks, spill_placement
from megatrain.planner.costs.cost_model import CostEstimate, PhaseTime
from megatrain.planner.profiling.hardware import GiB, HardwareProfile
from megatrain.planner.costs.memory_model import MemoryEstimate
from megatrain.planner.choice.search import PlanChoice


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:,.1f} GiB"


def seconds(s: float) -> str:
    if s >= 7200:
        return f"{s / 3600:,.1f} h"
    if s >= 120:
        return f"{s / 60:,.1f} min"
    if s >= 1.0:
        return f"{s:,.2f} s"
    return f"{s * 1e3:,.1f} ms"


def rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s:,.0f} tok/s"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], right: Sequence[bool] | None = None) -> str:
    """Columns aligned; numbers (``right``) right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = right or [False] * len(headers)

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if a else c.ljust(w) for c, w, a in zip(r, widths, align)).rstrip()

    return "\n".join([line(cells[0]), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]])


def hardware_line(hw: HardwareProfile) -> str:
    gpu = "no GPU (device = CPU)" if hw.device_is_host else f"{hw.gpu_name} {gib(hw.gpu_mem_bytes)}"
    link = "" if hw.device_is_host else (f"H2D {hw.h2d_gbps:.1f} / D2H {hw.d2h_gbps:.1f} / both {hw.duplex_gbps:.1f} "
                                         f"GB/s; ")  # no GPU: nothing crosses PCIe
    return (f"{gpu}; host RAM {gib(hw.host_budget_bytes)} usable of {gib(hw.host_ram_bytes)}; {link}"
            f"AdamW {hw.cpu_adam_params_per_s / 1e9:.2f} Gparam/s"
            + (f" + bf16 shadow {hw.cpu_shadow_params_per_s / 1e9:.2f} Gparam/s" if hw.cpu_shadow_params_per_s else "")
            + (f" (bf16 state {hw.cpu_bf16_state_params_per_s / 1e9:.2f} Gparam/s)" if hw.cpu_bf16_state_params_per_s
               else "")
            + f"; {hw.cores} cores" + (f"; {hw.interconnect}" if hw.interconnect not in ("none", "unknown") else ""))


def figures_note(hw: HardwareProfile) -> str | None:
    """Where ``hw``'s figures are not measured: one line saying what they are and the command that measures them
    (None for a measured profile)."""
    if hw.source.startswith("measured"):
        return None
    what = "a GPU preset's" if not hw.device_is_host else "rough guesses for this CPU, not measured"
    if not hw.device_is_host and hw.source.startswith("detected"):
        what = "the detected GPU with a preset's rates, not measured"
    return (f"these figures are {what}: `megatrain-plan profile` measures this machine (and --spill-dir DIR its "
            f"disk); plans made with them are estimates")


def adam_memory_line(hw: HardwareProfile) -> str:
    """CPU AdamW's memory traffic against the host's bandwidth, and AdamW with bf16 state against fp32 AdamW on
    the AdamW worker's threads; "not measured" for what an older profile lacks."""
    if hw.cpu_adam_gbps and hw.host_memory_gbps:
        adam = (f"AdamW moves {hw.cpu_adam_bytes_per_param} B/param: {hw.cpu_adam_gbps:.1f} GB/s of the host's "
                f"{hw.host_memory_gbps:.1f} GB/s memory bandwidth (triad), "
                f"{hw.cpu_adam_gbps / hw.host_memory_gbps:.0%}")
    else:
        adam = "AdamW's GB/s and the host's memory bandwidth: not measured"
    if not hw.cpu_bf16_state_params_per_s:
        return adam
    return (f"{adam}; AdamW with bf16 state {hw.cpu_bf16_state_params_per_s / 1e9:.2f} Gparam/s, "
            f"{hw.cpu_bf16_state_params_per_s / hw.adam_params_per_s:.2f}x fp32 AdamW on the worker's threads")


def device_adam_line(hw: HardwareProfile) -> str:
    """The GPU's fused AdamW (the resident blocks' update): measured, assumed, or none without a GPU."""
    if hw.device_is_host:
        return "GPU AdamW: none (no GPU; blocks' optimizer state stays in host RAM)"
    if not hw.device_adam_gbps:
        return f"GPU AdamW: not measured (the planner assumes {resident_blocks.DEVICE_ADAM_GBPS:.0f} GB/s)"
    per_param = resident_blocks.DEVICE_ADAM_BYTES_PER_PARAM
    return (f"GPU AdamW (fused, fp32 device buffers): {hw.device_adam_gbps:.0f} GB/s at {per_param} B/param, "
            f"{hw.device_adam_gbps / per_param:.1f} Gparam/s")


def profile_text(hw: HardwareProfile, saved_to: str) -> str:
    """What ``megatrain-plan profile`` measured, a line per resource."""
    attention = "; ".join(f"{k} " + ", ".join(f"{r:.2f} at {n:,} tokens" for n, r in pts)
                          for k, pts in hw.attention_tflops.items())
    return "\n".join([
        hardware_line(hw), "matmul TFLOP/s: " + ", ".join(f"{k} {v:.2f}" for k, v in hw.matmul_tflops.items()),
        "causal attention TFLOP/s (forward + backward): " + (attention or "not measured"),
        "AdamW by threads: " + ", ".join(f"{n}: {r / 1e9:.2f} Gparam/s" for n, r in hw.adam_by_threads),
        adam_memory_line(hw), device_adam_line(hw),
        *(["decoder layer compiled: " + ", ".join(f"{k} {r:.2f}x eager" for k, r in hw.compiled_layer_speedup.items())]
          if hw.compiled_layer_speedup else []),
        f"disk: read {hw.disk_read_gbps:.2f} / write {hw.disk_write_gbps:.2f} GB/s", f"source: {hw.source}",
        f"saved to {saved_to}"])


def memory_table(mem: MemoryEstimate) -> str:
    rows = [(c.where, c.name, gib(c.nbytes), "pinned" if c.pinned else "", c.formula) for c in mem.components]
    rows += [("device", "TOTAL", gib(mem.device_bytes), "", ""),
             ("host", "TOTAL", gib(mem.host_bytes), f"{gib(mem.pinned_host_bytes)} pinned", ""),
             ("nvme", "TOTAL", gib(mem.nvme_bytes), "", "")]
    return table(("where", "component", "size", "", "formula"), rows, (False, False, True, False, False))


def time_table(cost: CostEstimate, collectives: tuple[float, float] | None = None,
               device_is_host: bool = False) -> str:
    """Each phase's wall time and its resources' busy times; with ``collectives`` (a data-parallel rank's forward
    and backward collectives, ``data_parallel.collective_seconds``) a column of theirs, named as what bounds a
    phase where they bind it (``data_parallel.collectives_bind``; ``device_is_host``: CPU ranks)."""
    rows = []
    for k, (name, p) in enumerate((("forward", cost.forward), ("backward", cost.backward))):
        comm = () if collectives is None else (seconds(collectives[k]),)
        rows.append((name, seconds(p.seconds), seconds(p.compute_s), seconds(p.h2d_s), seconds(p.d2h_s), *comm,
                     seconds(p.adam_s), bound_by(p, None if collectives is None else collectives[k], device_is_host)))
    rows.append(("step", seconds(cost.step_seconds), "", "", "",
                 *(() if collectives is None else (seconds(sum(collectives)) + " overlapped",)),
                 seconds(cost.optimizer_exposed_seconds) + " exposed",
                 step_bound_by(cost, collectives, device_is_host)))
    comm_head = () if collectives is None else ("collectives",)
    return table(("phase", "wall", "compute", "H2D", "D2H", *comm_head, "CPU AdamW", "bound by"), rows,
                 (False, True, True, True, True, *((True,) if collectives else ()), True, False))


def bound_by(phase: PhaseTime, collectives: float | None = None, device_is_host: bool = False) -> str:
    """What bounds a phase: its busiest resource (``PhaseTime.bottleneck``), or a data-parallel rank's
    ``collectives`` where they bind it (``data_parallel.collectives_bind``, as the rank's phase is timed)."""
    if collectives is not None and data_parallel.collectives_bind(phase, collectives, device_is_host):
        return "collectives"
    return phase.bottleneck


def step_bound_by(cost: CostEstimate, collectives: tuple[float, float] | None = None,
                  device_is_host: bool = False) -> str:
    """What bounds the step: what bounds its longer phase (``bound_by``)."""
    k = 0 if cost.forward.seconds >= cost.backward.seconds else 1
    return bound_by((cost.forward, cost.backward)[k], None if collectives is None else collectives[k],
                    device_is_host)


def with_attention_tflops(c: CostEstimate) -> float:
    """Model TFLOP/s counting attention too: (6 x N_matmul per token x T + attention forward and backward by the
    model convention) / step."""
    return (c.model_flops + c.attention_flops) / c.step_seconds / 1e12


def choice_json(c: PlanChoice) -> dict[str, Any]:
    """A timed plan's figures, as every command's JSON gives them."""
    assert c.cost is not None
    return {**memory_json(c), "step_seconds": c.cost.step_seconds, "tokens_per_second": c.cost.tokens_per_second,
            "model_tflops": c.cost.model_tflops, "mfu": c.cost.mfu, "bottleneck": c.cost.bottleneck}


def memory_json(c: PlanChoice) -> dict[str, Any]:
    """The memory side of a plan (timed or not)."""
    return {"gpu_bytes": c.memory.device_bytes, "host_ram_bytes": c.memory.host_bytes,
            "pinned_host_bytes": c.memory.pinned_host_bytes, "nvme_bytes": c.memory.nvme_bytes,
            "disk_traffic_bytes_per_step": spill_placement.disk_traffic_bytes(c.memory.nvme_bytes),
            "spill": c.plan.spill}


def spill_text(c: PlanChoice) -> str:
    """'nothing on disk' or 'spills all: 120 GiB on disk, 240 GiB disk traffic per step'."""
    if c.plan.spill == "none":
        return "nothing on disk"
    return (f"spills {spill_placement.label(c.plan)}: {gib(c.memory.nvme_bytes)} on disk, "
            f"{gib(spill_placement.disk_traffic_bytes(c.memory.nvme_bytes))} disk traffic per step")


def disk_text(hw: HardwareProfile, measured: bool) -> str:
    how = "the hardware profile's figures" if measured else (
        "assumed, not measured: megatrain-plan profile --spill-dir DIR measures it, or pass --nvme GBPS")
    return f"read {hw.disk_read_gbps:.1f} / write {hw.disk_write_gbps:.1f} GB/s ({how})"


def emit(as_json: bool, data: dict[str, Any], text: str) -> None:
    """The answer on stdout: JSON for scripts, else the text."""
    print(json.dumps(data, indent=2, sort_keys=True) if as_json else text)
