"""What ``megatrain-plan`` with no command prints: each preset model on this machine (or a GPU preset): whether
it trains in RAM or with spill, at which batch, how fast, and the longest context; the largest model and the
largest Llama-shaped one for the RAM and disk. Text and JSON. Pure stdlib; formatting only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatrain.planner.shapes import model_shapes
from megatrain.planner.choice import sizing
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.planner.commands.report import (choice_json, disk_text, figures_note, gib, hardware_line, rate, seconds,
                                               table)
from megatrain.planner.shapes.workload import Workload


@dataclass(frozen=True)
class Overview:
    """What the overview found."""

    hw: HardwareProfile                         # its disk's figures assumed where not measured
    disk_measured: bool
    preset: bool                                # a GPU preset, not this machine
    work: Workload                              # the largest batch tried; the spill folder and its free space
    batches: tuple[int, ...]                    # the batches tried, largest first
    batch_given: bool                           # --batch: that one alone
    dtype: str                                  # --dtype, or the planner's choice for auto
    dtype_auto: bool
    answers: dict[str, sizing.ModelAnswer]      # per preset model
    largest_llama: sizing.LargestAnswer | None  # None: the disk's size is not known (a preset)


def page(o: Overview) -> tuple[dict[str, Any], str]:
    hw, work = o.hw, o.work
    rows, entries = [], []
    on_gpu = not hw.device_is_host
    for name, a in o.answers.items():
        model = a.model
        e: dict[str, Any] = {"model": name, "params": model.params, "feasible": a.choice is not None,
                             "fits": a.fits, "batch": a.batch, "reason": a.reason,
                             "spill_cost_seconds": a.spill_cost_seconds, "longest_context_batch1": a.longest_context}
        label = model_shapes.params_label(model.params)
        ctx = str(a.longest_context) if a.longest_context else "-"
        if a.choice is not None and a.choice.cost is not None:
            e.update(choice_json(a.choice))
            c, m = a.choice.cost, a.choice.memory
            spill_cost = "-" if a.fits == "ram" else f"+{seconds(a.spill_cost_seconds)}"
            rows.append((name, label, {"ram": "in RAM", "spill": "with spill"}[a.fits], a.batch,
                         seconds(c.step_seconds), rate(c.tokens_per_second),
                         # without a GPU the "device" buffers live in host RAM too
                         gib(m.host_bytes + (0 if on_gpu else m.device_bytes)))
                        + ((gib(m.device_bytes),) if on_gpu else ())
                        + (gib(m.nvme_bytes), spill_cost, ctx))
        else:
            rows.append((name, label, "no", "-", "-", "-", "-") + (("-",) if on_gpu else ()) + ("-", "-", ctx))
        entries.append(e)
    ok = [e for e in entries if e["feasible"]]
    largest = max(ok, key=lambda e: e["params"], default=None)
    largest_ram = max((e for e in ok if e["fits"] == "ram"), key=lambda e: e["params"], default=None)
    longest = max(entries, key=lambda e: e["longest_context_batch1"])
    big, free, spill_dir = o.largest_llama, work.spill_free_bytes, work.spill_dir
    seq, batch_label = work.seq_len, max(o.batches)
    disk = {"spill_dir": spill_dir if not o.preset else None, "free_bytes": free, "read_gbps": hw.disk_read_gbps,
            "write_gbps": hw.disk_write_gbps, "speed_measured": o.disk_measured}
    data = {"hardware": {"gpu_name": hw.gpu_name, "source": hw.source}, "seq_len": seq,
            "batch": work.batch if o.batch_given else "auto", "compute_dtype": o.dtype, "disk": disk,
            "models": entries, "largest_model": largest["model"] if largest else None,
            "largest_model_in_ram": largest_ram["model"] if largest_ram else None,
            "longest_context": {"model": longest["model"], "seq_len": longest["longest_context_batch1"]},
            "largest_llama": None if big is None else big.to_dict()}
    rates = hw.matmul_tflops
    why = ("" if not o.dtype_auto or o.dtype != "float32" else
           " (auto: what megatrain-train computes in on a CPU)" if hw.device_is_host else
           f" (auto: this hardware multiplies fp32 faster than bf16, {rates.get('float32', 0):.3g} vs "
           f"{rates.get('bfloat16', 0):.3g} TFLOP/s)")
    note = figures_note(hw) if not o.preset else None
    where = f"{spill_dir}, {gib(free)} free" if free is not None else f"{hw.gpu_name}'s host NVMe, any size"
    lines = [f"{'this machine' if not o.preset else 'hardware'}: {hardware_line(hw)}",
             f"  source: {hw.source}", *([f"  {note}"] if note else []),
             f"spill disk: {where}; {disk_text(hw, o.disk_measured)}",
             f"compute dtype: {o.dtype}{why}", "",
             f"each preset model at {'up to ' if not o.batch_given else ''}{batch_label} x {seq} tokens per step"
             + (" (the largest batch of " + ", ".join(map(str, o.batches)) + " that fits)" if not o.batch_given
                else "") + ":",
             table(("model", "params", "fits", "batch", "step", "throughput", "host RAM")
                   + (("GPU mem",) if on_gpu else ()) + ("NVMe", "spill cost", "max seq (batch 1)"), rows,
                   (False, True, False, True, True, True, True) + ((True,) if on_gpu else ()) + (True, True, True)),
             "",
             f"largest model it can train: {largest['model'] if largest else 'none of the presets'}"
             + (" (with spill)" if largest and largest["fits"] == "spill" else "")
             + (f"; in RAM alone: {largest_ram['model']}" if largest_ram and largest_ram is not largest else "")
             + f"; longest context: {longest['longest_context_batch1']} tokens ({longest['model']}, batch 1)"]
    lines += [] if big is None else [big.line() + f" (batch 1 x {seq} tokens)"]
    for e in entries:
        if not e["feasible"]:
            lines.append(f"  {e['model']}: {e['reason']}")
    return data, "\n".join(lines)
