"""Derived figures and the report: ``<date>_<device>_peers.{json,md,png}``.

Model TFLOP/s = 6 x N_matmul x tokens / step time (benchmarks/README.md): N_matmul the parameters of
the matrix multiplies a token runs through (lm_head included, the input embedding a lookup), every
token of the batch counted (no padding here). Neither the recompute of activation checkpointing
nor attention is counted in it; the every-parameter figure (6 x every parameter) is given beside it
and attention TFLOP/s apart (causal, forward + backward 2x forward, from the planner's model shape).
MFU is model TFLOP/s over the matmul peak measured at the start of the same run, and over the
device's datasheet dense bf16 peak where it is known. Step time is the median of the timed steps after
the warm-up, with their min and max; the protocol asks for at least 5 of them. Every run keeps the
header of the machine and the run it was measured on (date, command, matmul peak), so a report that
merges runs (``--resume``) states each run's own. Loss agreement: each system's final (and first) loss
against the reference system's of the same case (PyTorch in memory, else the first system that ran),
relative. A system run at several micro-batches (DeepSpeed ZeRO-3) has its best marked.
"""
from __future__ import annotations

import json
import os
import statistics
from typing import Any

from flop_figures import figures  # benchmarks/flop_figures.py, beside this package

from .spec import SYSTEMS, RunSpec

GIB = 2**30
BREAKDOWN_KEYS = ("step_s", "compute_s", "h2d_exposed_s", "d2h_exposed_s", "ckpt_traffic_s", "adam_exposed_s",
                  "h2d_busy_s", "d2h_busy_s", "adam_busy_s", "roofline_s", "roofline_ratio")


MIN_TIMED_STEPS = 5  # the protocol's steady state: at least this many timed steps after the warm-up


def case_key(row: dict[str, Any]) -> tuple:
    """One comparison: the same model, sequence, global batch and device (micro-batches may differ)."""
    return (row["model"], row["seq"], row["batch"], row["device"])


def run_key(row: dict[str, Any]) -> tuple:
    """The same identity as ``RunSpec.key()``."""
    return (row["system"], row["model"], row["seq"], row["batch"], row["micro_batch"], row["device"])


def derive(spec: RunSpec, raw: dict[str, Any], shape: Any, peak_tflops: float, gpu: str | None = None
           ) -> dict[str, Any]:
    """One report row from a child's raw result. ``shape`` is the planner's ModelShape of the model, ``gpu`` the
    device's CUDA name (for its datasheet peak)."""
    row: dict[str, Any] = {
        "system": spec.system, "model": spec.model, "layers": spec.config["num_hidden_layers"],
        "params": shape.params, "seq": spec.seq, "batch": spec.batch, "micro_batch": spec.micro_batch,
        "tokens_per_step": spec.tokens, "steps": spec.steps, "warmup": spec.warmup, "device": spec.device,
    }
    row.update({k: v for k, v in raw.items() if k != "params"})
    row["system_params"] = raw.get("params")  # the system's own count; "params" is the shape's
    if raw.get("status") != "ok":
        return row
    steady = raw["step_seconds"][spec.warmup:]
    step = statistics.median(steady)
    row.update(median_step_seconds=step, min_step_seconds=min(steady), max_step_seconds=max(steady),
               timed_steps=len(steady), steady_state=len(steady) >= MIN_TIMED_STEPS,
               tokens_per_second=spec.tokens / step, **figures(shape, spec.tokens, step, spec.seq, peak_tflops, gpu),
               first_loss=raw["losses"][0], final_loss=raw["losses"][-1])
    row["mfu"] = row["mfu_measured_matmul"]
    if row["system_params"] is not None and row["system_params"] != shape.params:
        row["params_mismatch"] = f"the system counts {row['system_params']} parameters, the model shape {shape.params}"
    breakdowns = [b for b in raw.get("breakdowns", [])[spec.warmup:] if b]
    if breakdowns:
        med = {k: statistics.median(vs) for k in BREAKDOWN_KEYS if (vs := [b[k] for b in breakdowns if k in b])}
        row["breakdown_median"] = med
        # Step over compute: 1.0 when no transfer or AdamW time is exposed. Roofline ratio: step over
        # max(compute, H2D busy, D2H busy, AdamW busy), 1.0 when every resource hides behind the slowest.
        row["step_over_compute"] = med["step_s"] / med["compute_s"] if med.get("compute_s") else None
        row["roofline_ratio"] = med.get("roofline_ratio")
    return row


def mark_best(rows: list[dict[str, Any]]) -> None:
    """Per case and system run at several micro-batches: ``best_of_sweep`` on the fastest ok row (in place)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(case_key(r) + (r["system"],), []).append(r)
    for group in groups.values():
        if len(group) < 2:
            continue
        ok = [r for r in group if r.get("status") == "ok"]
        best = min(ok, key=lambda r: r["median_step_seconds"]) if ok else None
        for r in group:
            r["best_of_sweep"] = r is best


def headers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The distinct machine-and-run headers of the rows (``run_header``), in the order they first appear."""
    out: list[dict[str, Any]] = []
    for r in rows:
        h = r.get("run_header")
        if h is not None and h not in out:
            out.append(h)
    return out


def agree(rows: list[dict[str, Any]]) -> None:
    """Set each ok row's loss difference against its case's reference system (in place)."""
    cases: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        cases.setdefault(case_key(r), []).append(r)
    for group in cases.values():
        ok_rows = [r for r in group if r.get("status") == "ok"]
        ok = {r["system"]: r for r in ok_rows}
        ref_name = "pytorch" if "pytorch" in ok else next((s for s in SYSTEMS if s in ok), None)
        if ref_name is None:
            continue
        ref = ok[ref_name]
        for r in ok_rows:
            r["loss_reference"] = ref_name
            r["final_loss_rel_diff"] = abs(r["final_loss"] - ref["final_loss"]) / abs(ref["final_loss"])
            r["first_loss_rel_diff"] = abs(r["first_loss"] - ref["first_loss"]) / abs(ref["first_loss"])


def largest(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per sequence length and system: the most parameters that ran ok (over every model of the report)."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r.get("status") != "ok":
            continue
        best = out.setdefault(str(r["seq"]), {}).get(r["system"])
        if best is None or r["params"] > best["params"]:
            out[str(r["seq"])][r["system"]] = {"params": r["params"], "model": r["model"], "layers": r["layers"]}
    return out


def device_label(machine: dict[str, Any]) -> str:
    if machine.get("device") != "cuda":
        return "cpu"
    name = machine.get("gpu", "gpu").replace("NVIDIA ", "")
    return "".join(c if c.isalnum() or c in "-." else "-" for c in name).strip("-")


def run_header(machine: dict[str, Any], date: str, command: str | None) -> dict[str, Any]:
    """What a run was measured on and by: stamped on its row, kept when a report merges runs."""
    return {"date": date, "command": command, "matmul_peak_tflops": machine["matmul_peak"]["tflops"],
            "machine": machine}


def build(machine: dict[str, Any], date: str, settings: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    agree(rows)
    mark_best(rows)
    return {"benchmark": "peers", "date": date, "device": device_label(machine), "machine": machine,
            "matmul_peak_tflops": machine["matmul_peak"]["tflops"], "conventions": __doc__.split("\n\n", 1)[1].strip(),
            "settings": settings, "runs": rows, "largest": largest(rows), "run_headers": headers(rows)}


def _gib(v: Any) -> str:
    return "-" if v is None else f"{v / GIB:.2f}"


def size(params: int) -> str:
    """1.24B, 158.0K: a parameter count for people."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if params >= div:
            return f"{params / div:.2f}{unit}"
    return str(params)


def _detail(key: str, value: Any) -> str:
    if key.endswith("_bytes") and isinstance(value, (int, float)):
        return f"{key[:-6].replace('_', ' ')} {value / GIB:.2f} GiB"
    if key.endswith("_seconds") and isinstance(value, (int, float)):
        return f"{key[:-8].replace('_', ' ')} {value:.3f} s"
    return f"{key.replace('_', ' ')}: {value}"


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _machine_line(m: dict[str, Any]) -> str:
    what = (f"{m['gpu']} ({m['gpu_memory_bytes'] / GIB:.0f} GiB), driver {m.get('driver')}, CUDA {m.get('cuda')}, "
            if m.get("device") == "cuda" else "no GPU (CPU run), ")
    return (f"{what}{m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), "
            f"{_gib(m.get('host_ram_bytes'))} GiB RAM; Python {m['python']}, torch {m['torch']}, "
            f"transformers {m.get('transformers')}, deepspeed {m.get('deepspeed') or 'not installed'}")


def _header_lines(report: dict[str, Any]) -> list[str]:
    """The machine and matmul peak: the report's own, or each merged run's own (``run_header``) when they differ."""
    hs = report.get("run_headers") or []
    if len(hs) <= 1:
        m = hs[0]["machine"] if hs else report["machine"]
        peak = m["matmul_peak"]
        return [f"Machine: {_machine_line(m)}.", "",
                f"Matmul peak measured in this run: **{peak['tflops']:.1f} TFLOP/s** ({peak['dtype']}, {peak['n']}^3).",
                ""]
    lines = [f"This report merges runs measured on {len(hs)} machines or days; each row names its run (r1, r2, ...), "
             "and its MFU is against its own run's matmul peak:", ""]
    for i, h in enumerate(hs, 1):
        peak = h["machine"]["matmul_peak"]
        lines.append(f"- r{i}: {h['date']}, {_machine_line(h['machine'])}; matmul peak **{peak['tflops']:.1f} "
                     f"TFLOP/s** ({peak['dtype']}); command `{h.get('command')}`")
    return lines + [""]


def markdown(report: dict[str, Any]) -> str:
    hs = report.get("run_headers") or []
    lines = [f"# megatrain and its peers: {report['device']}, {report['date']}", "",
             *_header_lines(report),
             report["conventions"].replace("\n", " "), "",
             f"Each system runs in a fresh process; step time is the median (min-max) of the steps after the first "
             f"{report['settings']['warmup']} (warm-up). Host used: how far the machine's available memory fell "
             f"during the run (pinned memory included). Pinned: torch's pinned allocator's peak plus what the "
             f"system registered itself.", ""]
    cases: dict[tuple, list[dict[str, Any]]] = {}
    for r in report["runs"]:
        cases.setdefault(case_key(r), []).append(r)
    for (model, seq, batch, _), group in cases.items():
        r0 = group[0]
        lines += [f"## {model}: {size(r0['params'])} parameters ({r0['layers']} layers), seq {seq}, "
                  f"batch {batch}: {batch * seq:,} tokens/step", "",
                  "| system | micro | status | step s (min-max) | tokens/s | model TFLOP/s (6 N_matmul) | all-param "
                  "TFLOP/s | MFU measured / datasheet | attention TFLOP/s | peak GPU GiB | peak host RSS GiB (setup) "
                  "| host used GiB | pinned GiB | first loss | final loss | final vs reference |", "|" + "---|" * 16]
        for r in sorted(group, key=lambda r: (SYSTEMS.index(r["system"]), r["micro_batch"])):
            pinned = [v for v in (r.get("torch_pinned_peak_bytes"), r.get("system_pinned_bytes")) if v]
            rel = r.get("final_loss_rel_diff")
            ref = "" if rel is None else f"{rel:.2e} ({r['loss_reference']})"
            rss = _gib(r.get("peak_host_rss_bytes"))
            if r.get("setup_peak_host_rss_bytes") is not None:
                rss += f" ({_gib(r['setup_peak_host_rss_bytes'])})"
            status = r["status"].replace("|", "/")
            name = r["system"] + (" **(best)**" if r.get("best_of_sweep") else "")
            if len(hs) > 1 and r.get("run_header") in hs:
                name += f" (r{hs.index(r['run_header']) + 1})"
            step = _num(r.get("median_step_seconds"), ".3f")
            if r.get("min_step_seconds") is not None:
                step += f" ({r['min_step_seconds']:.3f}-{r['max_step_seconds']:.3f}, {r['timed_steps']} timed)"
            lines.append(
                f"| {name} | {r['micro_batch']} | {status} | {step} "
                f"| {_num(r.get('tokens_per_second'), ',.0f')} | {_num(r.get('model_tflops'), '.2f')} "
                f"| {_num(r.get('all_params_tflops'), '.2f')} "
                f"| {_num(r.get('mfu'), '.1%')} / {_num(r.get('mfu_datasheet'), '.1%')} "
                f"| {_num(r.get('attention_tflops'), '.2f')} "
                f"| {_gib(r.get('peak_gpu_bytes'))} | {rss} | {_gib(r.get('host_used_peak_bytes'))} "
                f"| {_gib(sum(pinned)) if pinned else '-'} | {_num(r.get('first_loss'), '.4f')} "
                f"| {_num(r.get('final_loss'), '.4f')} | {ref} |")
        short = [r for r in group if r.get("status") == "ok" and not r.get("steady_state")]
        if short:
            lines += ["", f"Fewer than {MIN_TIMED_STEPS} timed steps (not the protocol's steady state): "
                      + ", ".join(sorted({r['system'] for r in short})) + "."]
        lines.append("")
        for r in group:
            bd = r.get("breakdown_median")
            if bd:
                parts = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.3f}" for k, v in bd.items())
                lines += [f"megatrain step breakdown (median seconds): {parts}; step / compute "
                          f"{_num(r.get('step_over_compute'), '.2f')}; step / roofline "
                          f"{_num(r.get('roofline_ratio'), '.2f')} (roofline: max of compute and the H2D, "
                          "D2H and AdamW busy times).", ""]
        for r in sorted(group, key=lambda r: SYSTEMS.index(r["system"])):
            d = r.get("details")
            if d:
                shown = {k: v for k, v in d.items() if k not in ("config", "plan")}
                if "plan" in d:
                    p = d["plan"]
                    shown["plan"] = (f"micro-batch {p['micro_batch_size']}, {p['num_slots']} slots, prefetch "
                                     f"{p['prefetch_depth']}, checkpoints on {p['checkpoints']}, optimizer "
                                     f"{p['optimizer_mode']}, loss chunk {p['loss_chunk_tokens']}")
                lines.append(f"- {r['system']}: " + "; ".join(_detail(k, v) for k, v in shown.items()))
        lines.append("")
    if any(len(v) for v in report["largest"].values()) and len({r["model"] for r in report["runs"]}) > 1:
        lines += ["## Largest model that ran, per sequence length", "", "| seq | " + " | ".join(SYSTEMS) + " |",
                  "|---|" + "---|" * len(SYSTEMS)]
        for seq, per in report["largest"].items():
            cells = [f"{size(per[s]['params'])} ({per[s]['model']})" if s in per else "-" for s in SYSTEMS]
            lines.append(f"| {seq} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> str:
    """Tokens/s against model size, one panel per sequence length, one line per system. Returns the path,
    or why there is no figure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed (pip install matplotlib)"
    ok = [r for r in report["runs"] if r.get("status") == "ok"]
    if not ok:
        return "skipped: no run finished"
    seqs = sorted({r["seq"] for r in ok})
    fig, axes = plt.subplots(1, len(seqs), figsize=(6 * len(seqs), 4.5), squeeze=False)
    failed = [r for r in report["runs"] if r["status"].startswith(("out of memory", "failed"))]
    for ax, seq in zip(axes[0], seqs):
        for system in SYSTEMS:
            pts = sorted((r["params"] / 1e9, r["tokens_per_second"]) for r in ok
                         if r["seq"] == seq and r["system"] == system)
            if pts:
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
                # The sizes where it failed: crosses on the axis, in its colour.
                xs = [r["params"] / 1e9 for r in failed if r["seq"] == seq and r["system"] == system]
                ax.plot(xs, [0] * len(xs), "x", color=line.get_color(), ms=9, clip_on=False)
        tokens = sorted({r["tokens_per_step"] for r in ok if r["seq"] == seq})
        ax.set_title(f"seq {seq}, {', '.join(f'{t:,}' for t in tokens)} tokens/step")
        ax.set_xlabel("parameters (billions)")
        ax.set_ylabel("tokens / s (x: failed at that size)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"Training throughput, {report['device']}, {report['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(report: dict[str, Any], stem: str) -> dict[str, str]:
    """Write ``stem``.json, .md and .png; returns what went where (the PNG's entry may say why it is absent)."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    report["figure"] = plot(report, stem + ".png")
    tmp = stem + ".json.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, stem + ".json")
    text = markdown(report)
    if not report["figure"].startswith("skipped"):
        text += f"\n![tokens/s against model size]({os.path.basename(stem)}.png)\n"
    else:
        text += f"\nNo figure: {report['figure']}.\n"
    with open(stem + ".md", "w") as f:
        f.write(text)
    return {"json": stem + ".json", "md": stem + ".md", "png": report["figure"]}


def load(stem: str) -> dict[str, Any] | None:
    try:
        with open(stem + ".json") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
