"""Human-readable tables for megatrain-plan: plain text, aligned columns, units a person reads at a glance.

Pure stdlib; no numbers are computed here, only formatted.
"""
from __future__ import annotations

from typing import Sequence

from .cost_model import CostEstimate
from .hardware import GiB, HardwareProfile
from .memory_model import MemoryEstimate


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
    return (f"{gpu}; host RAM {gib(hw.host_budget_bytes)} usable of {gib(hw.host_ram_bytes)}; "
            f"H2D {hw.h2d_gbps:.1f} / D2H {hw.d2h_gbps:.1f} / both {hw.duplex_gbps:.1f} GB/s; "
            f"AdamW {hw.cpu_adam_params_per_s / 1e9:.2f} Gparam/s"
            + (f" + bf16 shadow {hw.cpu_shadow_params_per_s / 1e9:.2f} Gparam/s" if hw.cpu_shadow_params_per_s else "")
            + f"; {hw.cores} cores; {hw.interconnect}")


def profile_text(hw: HardwareProfile, saved_to: str) -> str:
    """What ``megatrain-plan profile`` measured, a line per resource."""
    attention = "; ".join(f"{k} " + ", ".join(f"{r:.2f} at {n:,} tokens" for n, r in pts)
                          for k, pts in hw.attention_tflops.items())
    return "\n".join([
        hardware_line(hw), "matmul TFLOP/s: " + ", ".join(f"{k} {v:.2f}" for k, v in hw.matmul_tflops.items()),
        "causal attention TFLOP/s (forward + backward): " + (attention or "not measured"),
        "AdamW by threads: " + ", ".join(f"{n}: {r / 1e9:.2f} Gparam/s" for n, r in hw.adam_by_threads),
        f"disk: read {hw.disk_read_gbps:.2f} / write {hw.disk_write_gbps:.2f} GB/s", f"source: {hw.source}",
        f"saved to {saved_to}"])


def memory_table(mem: MemoryEstimate) -> str:
    rows = [(c.where, c.name, gib(c.nbytes), "pinned" if c.pinned else "", c.formula) for c in mem.components]
    rows += [("device", "TOTAL", gib(mem.device_bytes), "", ""),
             ("host", "TOTAL", gib(mem.host_bytes), f"{gib(mem.pinned_host_bytes)} pinned", ""),
             ("nvme", "TOTAL", gib(mem.nvme_bytes), "", "")]
    return table(("where", "component", "size", "", "formula"), rows, (False, False, True, False, False))


def time_table(cost: CostEstimate) -> str:
    rows = []
    for name, p in (("forward", cost.forward), ("backward", cost.backward)):
        rows.append((name, seconds(p.seconds), seconds(p.compute_s), seconds(p.h2d_s), seconds(p.d2h_s),
                     seconds(p.adam_s), p.bottleneck))
    rows.append(("step", seconds(cost.step_seconds), "", "", "", seconds(cost.optimizer_exposed_seconds) +
                 " exposed", cost.bottleneck))
    return table(("phase", "wall", "compute", "H2D", "D2H", "CPU AdamW", "bound by"), rows,
                 (False, True, True, True, True, True, False))


def with_attention_tflops(c: CostEstimate) -> float:
    """Model TFLOP/s counting attention too: (6N per token x T + attention forward and backward) / step."""
    return (c.model_flops + c.attention_flops) / c.step_seconds / 1e12
