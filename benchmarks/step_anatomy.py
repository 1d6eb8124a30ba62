"""Where megatrain's step goes, per configuration, and how far it is from its roofline.

    python benchmarks/step_anatomy.py --model tiny --seq 64 --batch 8 --micro-batch 4           # a CPU check
    python benchmarks/step_anatomy.py --model 1b,3b --seq 2048,8192 --batch 16 --micro-batch 4   # on a GPU

For each model x sequence length (and each --variant of the planner's plan), one engine
runs --warmup steps, then --steps timed steps reading ``engine.last_step_breakdown`` (event
timing: compute, exposed H2D / D2H / checkpoint traffic / AdamW, and each resource's busy
time), then --traced steps under torch.profiler, whose trace gives the kernels' own time and
the copies' device time (tools/trace_anatomy.py), and the kernels' time by category: GEMM, attention, norms,
RoPE, SwiGLU, cross-entropy, copies, other elementwise, torch.compile's fused kernels (the ``compiled`` variant's),
the optimizer (tools/kernel_categories.py). The
timed steps' figures are written before the trace starts: a trace cut short by a time limit leaves them. The roofline is max(compute, H2D, D2H,
CPU AdamW) for the plan that ran (AdamW on the compute thread: max(compute + AdamW, H2D, D2H));
the ratio is step / roofline (the target: within 1.10). Both readings are reported: the event timer's compute still holds launch gaps, the
trace's does not. Beside them, the planner's cost model for the same plan (its step and
busy times, and the FLOPs its recomputed layers run again in backward: the layers it does not keep),
so each run also checks the planner. Writes benchmarks/results/<date>_<device>_step_anatomy.{json,md}, and
with --trace-dir one Chrome trace per configuration.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from peer_runners import probe, report  # noqa: E402
from peer_runners.run_megatrain import import_megatrain, plan_for  # noqa: E402
from peer_runners.spec import MODELS, RunSpec, model_config, model_label  # noqa: E402
from peer_runners.weights import model_shape  # noqa: E402
from flop_figures import figures  # noqa: E402
from result_files import new_base  # noqa: E402

VARIANTS = {  # plan changes tried beside the planner's own choice
    "planner": {},
    "host-ckpt": {"checkpoints": "host", "kept_layers": ()},  # checkpoints only exist for recomputed layers
    "device-ckpt": {"checkpoints": "device", "kept_layers": ()},
    "eager": {"optimizer_mode": "eager"},
    "deferred": {"optimizer_mode": "deferred"},
    "prefetch1": {"prefetch_depth": 1},
    "recompute-all": {"kept_layers": ()},  # every layer recomputed from its checkpoint
    "keep-all": {"kept_layers": "all"},  # every layer's activations kept for backward
    "host-cast": {"weights_cast": "host"},  # bf16 weights rounded by AdamW into a shadow in RAM
    "device-cast": {"weights_cast": "device"},  # the fp32 master copied and rounded on the device
    "uncompiled": {"compiled_layers": False},  # the decoder layers' forward eager (the default)
    "compiled": {"compiled_layers": True},  # through torch.compile ([Note: compiled layers]; warm-up compiles)
}


def predict(spec: RunSpec, plan: Any, clipping: bool, hw: Any) -> dict[str, Any]:
    """The planner's cost model for exactly this plan: step seconds and each resource's busy seconds."""
    from megatrain.planner.costs import cost_model, memory_model
    from megatrain.planner.shapes import model_shapes
    from megatrain.planner.shapes.workload import Workload

    work = Workload(spec.seq, spec.batch, compute_dtype="bf16" if spec.device == "cuda" else "fp32",
                    clipping=clipping, spill="none")
    shape = model_shapes.from_config(spec.config)
    c = cost_model.estimate(shape, work, plan, hw)
    f, b = c.forward, c.backward
    pinned = memory_model.estimate(shape, work, plan, hw).pinned_host_bytes
    return {"step_s": c.step_seconds, "pinned_host_bytes": pinned, "compute_s": f.compute_s + b.compute_s,
            "h2d_s": f.h2d_s + b.h2d_s,
            "d2h_s": f.d2h_s + b.d2h_s, "adam_s": f.adam_s + b.adam_s, "bottleneck": c.bottleneck,
            "recompute_flops": c.recompute_flops, "hardware_flops": c.hardware_flops}


def measure(spec: RunSpec, variant: str, args: argparse.Namespace, hw: Any, echo,
            keep: Callable[[dict[str, Any]], None] = lambda row: None) -> dict[str, Any]:
    """One configuration's row; ``keep(row)`` is called with the timed steps' row before any trace starts."""
    import torch

    from megatrain.runtime import Engine, ModelConfig, OptimizerConfig

    plan, said = plan_for(spec, clipping=not args.no_clip)
    if args.planner_only and said["planner"] != "best of the search":
        return {"model": spec.model, "seq": spec.seq, "batch": spec.batch, "variant": variant,
                "status": f"not run: {said['planner']}"}
    changes = dict(VARIANTS[variant])
    if changes.get("kept_layers") == "all":
        changes["kept_layers"] = tuple(range(spec.config["num_hidden_layers"]))
    if changes.get("optimizer_mode") == "eager":
        changes["host_grad_slabs"] = max(plan.host_grad_slabs, 2)
        changes["compute_in_place"] = False  # eager updates take gradients from slabs
    try:
        plan = plan.replace(**changes) if changes else plan
    except ValueError as e:  # a PlanError: e.g. compiled layers with the sequence tiles the planner chose
        return {"model": spec.model, "seq": spec.seq, "batch": spec.batch, "variant": variant,
                "status": f"not run: {e}"}
    clip = None if plan.optimizer_mode == "eager" or args.no_clip else spec.max_grad_norm  # eager cannot clip
    cuda = spec.device == "cuda"
    row: dict[str, Any] = {"model": spec.model, "seq": spec.seq, "batch": spec.batch, "variant": variant,
                           "layers": spec.config["num_hidden_layers"],
                           "plan": plan.to_dict(), "clipping": clip is not None, **said,
                           "predicted": predict(spec, plan, clip is not None, hw)}
    gen = torch.Generator().manual_seed(spec.seed)
    ids = [torch.randint(0, spec.config["vocab_size"], (spec.batch, spec.seq), generator=gen) for _ in range(2)]
    try:
        engine = Engine(ModelConfig.from_hf(spec.config), OptimizerConfig(lr=spec.lr, max_grad_norm=clip), plan=plan,
                        compute_dtype=torch.bfloat16 if cuda else torch.float32, device=spec.device, seed=spec.seed)
    except Exception as e:  # e.g. out of memory: recorded, the next configuration runs
        return {**row, "status": f"failed at start: {str(e).splitlines()[0]}"}
    with engine:
        try:
            return _timed(engine, spec, variant, row, ids, args, echo, keep)
        except torch.OutOfMemoryError as e:  # recorded with what ran before it
            return {**row, "status": f"out of memory in a step: {str(e).splitlines()[0]}"}


def _timed(engine: Any, spec: RunSpec, variant: str, row: dict[str, Any], ids: list, args: argparse.Namespace,
           echo, keep: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    import resource

    import torch

    from megatrain.tools.kernel_categories import kernel_breakdown
    from megatrain.tools.trace_anatomy import anatomy, profile_kwargs

    cuda = spec.device == "cuda"
    if cuda:  # this configuration's peaks alone, GPU and pinned host memory
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_peak_host_memory_stats()
    breakdowns, steps = [], []
    t_prev = time.perf_counter()
    for i in range(args.warmup + args.steps):
        if i >= args.warmup:
            engine.time_next_step()
        # .item(): the step's end as a loop that logs its loss sees it. A step's time is the interval between two
        # such ends, so the AdamW a step defers is in the interval it delays (benchmarks/README.md, steady state).
        loss = engine.step(ids[i % 2], ids[i % 2]).item()
        now = time.perf_counter()
        steps.append(now - t_prev)
        t_prev = now
        if i >= args.warmup:
            breakdowns.append(engine.last_step_breakdown)
        echo(f"  {spec.model} seq {spec.seq} {variant}: step {i + 1}/{args.warmup + args.steps} "
             f"{steps[-1]:.3f} s, loss {loss:.4f}")
    engine.synchronize()
    keys = [k for k in breakdowns[-1] if all(k in b for b in breakdowns)]
    row["events"] = {k: statistics.median(b[k] for b in breakdowns) for k in keys}
    steady = steps[args.warmup:]
    step = statistics.median(steady)
    # 6 x N_matmul per token, no recompute, no attention; the every-parameter figure and attention beside it
    flops = figures(model_shape(spec), spec.tokens, step, spec.seq, args.matmul_peak_tflops,
                    torch.cuda.get_device_name() if cuda else None)
    row.update(status="ok", median_step_seconds=step, min_step_seconds=min(steady), max_step_seconds=max(steady),
               timed_steps=len(steady), step_seconds=steps, tokens_per_second=spec.tokens / step,
               params=engine.num_parameters, **flops, mfu=flops["mfu_measured_matmul"],
               peak_gpu_bytes=torch.cuda.max_memory_allocated() if cuda else None,
               peak_gpu_reserved_bytes=torch.cuda.max_memory_reserved() if cuda else None,
               peak_host_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               pinned_host_bytes=_pinned_bytes(engine, cuda), final_loss=loss, trace=None, kernels=None)
    if not args.traced:  # at long sequences the profiler's parse takes longer than the steps: --traced 0
        return row
    keep(row)  # the timed steps' figures on disk before the trace (an 8B step's parse takes about a minute)
    with torch.profiler.profile(**profile_kwargs(cuda)) as prof:
        t0 = time.perf_counter()
        for i in range(args.traced):
            engine.step(ids[i % 2], ids[i % 2])
        engine.synchronize()
        traced_step = (time.perf_counter() - t0) / args.traced
    events = prof.events()
    row["trace"] = anatomy(events, args.traced, traced_step)
    row["kernels"] = kernel_breakdown(events, args.traced)
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        path = os.path.join(args.trace_dir, f"{spec.model}_seq{spec.seq}_{variant}.json")
        prof.export_chrome_trace(path)
        row["trace_file"] = path
    return row


def _pinned_bytes(engine: Any, cuda: bool) -> int:
    """Pinned host memory, against the planner's ``pinned_host_bytes``: the arenas the engine registered with the
    driver (its store's and the host checkpoints'), plus the peak of torch's pinned allocator (spill bounce buffers,
    inputs). /proc's VmLck and VmPin do not count pages registered with cudaHostRegister: they read 0 on an H200
    machine."""
    import torch

    allocator = int(torch.cuda.host_memory_stats().get("allocated_bytes.peak", 0)) if cuda else 0
    return engine.store.pinned_bytes + engine.executor.checkpoints.pinned_bytes + allocator


def markdown(rep: dict[str, Any]) -> str:
    lines = [f"# megatrain step anatomy, {rep['device']} ({rep['date']})", "",
             "Seconds per step. events: the engine's own event timing (median of the timed steps; its compute "
             "holds launch gaps); trace: torch.profiler (kernels and copies on the device, AdamW on its "
             "thread). Roofline = max(compute, H2D, D2H, AdamW), with AdamW on the compute thread max(compute + AdamW, "
             "H2D, D2H); ratio = step / roofline (target <= 1.10).", "",
             "Model TFLOP/s = 6 x N_matmul x tokens / median step (benchmarks/README.md); MFU against the matmul "
             "measured in this run and the device's datasheet dense bf16 peak; all-param: 6 x every parameter.", "",
             "| model | seq | variant | plan | step s (min-max) | tokens/s | model TFLOP/s (MFU run / datasheet; "
             "all-param) | peak GPU / host GiB, pinned "
             "| events: compute / H2D / D2H / AdamW busy | "
             "exposed H2D / D2H / ckpt / AdamW | events ratio | trace: compute / H2D / D2H / AdamW / of it bf16 shadow "
             "| bound by "
             "| trace ratio | planner: step / compute / H2D / D2H / AdamW | kept layers | recomputed GFLOP / of "
             "hardware GFLOP |", "|" + "---|" * 17]
    for r in rep["runs"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['model']} | {r['seq']} | {r['variant']} | - | {r.get('status')} |"
                         + "  |" * 12)
            continue
        p, e, q = r["plan"], r["events"], r["predicted"]
        t = r["trace"] or dict.fromkeys(("compute_s", "h2d_s", "d2h_s", "adam_s", "shadow_s", "roofline_ratio"))
        t["bound_by"] = t.get("bound_by") or "not traced"
        f = lambda *vals: " / ".join("-" if v is None else f"{v:.3f}" for v in vals)  # noqa: E731
        lines.append(
            f"| {r['model']} | {r['seq']} | {r['variant']} | mb {p['micro_batch_size']}, {p['num_slots']} slots, "
            f"ckpt {p['checkpoints']}, {p['optimizer_mode']}"
            f"{', cast on device' if p.get('weights_cast') == 'device' else ''}"
            f"{', compiled layers' if p.get('compiled_layers') else ''} | {r['median_step_seconds']:.3f} "
            f"({r['min_step_seconds']:.3f}-{r['max_step_seconds']:.3f}, {r['timed_steps']} timed) "
            f"| {r['tokens_per_second']:,.0f} | {r['model_tflops']:.1f} ({r['mfu']:.1%} / "
            f"{'-' if r['mfu_datasheet'] is None else format(r['mfu_datasheet'], '.1%')}; "
            f"{r['all_params_tflops']:.1f}) "
            f"| {(r['peak_gpu_bytes'] or 0) / 2**30:.1f} / {r['peak_host_rss_bytes'] / 2**30:.1f}, pinned "
            f"{(r.get('pinned_host_bytes') or 0) / 2**30:.1f} (planner {q['pinned_host_bytes'] / 2**30:.1f}) "
            f"| {f(e['compute_s'], e['h2d_busy_s'], e['d2h_busy_s'], e.get('adam_busy_s'))} "
            f"| {f(e['h2d_exposed_s'], e['d2h_exposed_s'], e['ckpt_traffic_s'], e['adam_exposed_s'])} "
            f"| {e['roofline_ratio']:.2f} | {f(t['compute_s'], t['h2d_s'], t['d2h_s'], t['adam_s'], t['shadow_s'])} "
            f"| {t['bound_by']} | {f(t['roofline_ratio'])} "
            f"| {f(q['step_s'], q['compute_s'], q['h2d_s'], q['d2h_s'], q['adam_s'])} "
            f"| {len(p.get('kept_layers', ()))} of {r['layers']} "
            f"| {q['recompute_flops'] / 1e9:,.1f} / {q['hardware_flops'] / 1e9:,.1f} |")
    lines += kernel_table(rep["runs"])
    lines += ["", f"Machine: {rep['machine'].get('gpu') or rep['machine'].get('cpu')}, {rep['machine'].get('cores')} "
              f"cores, torch {rep['machine'].get('torch')}. Command: `{rep['command']}`.", ""]
    return "\n".join(lines)


def kernel_table(runs: list[dict[str, Any]]) -> list[str]:
    """The traced steps' kernel time by category (seconds per step, share of the kernels' total), one row a traced
    configuration; none without one."""
    from megatrain.tools.kernel_categories import ORDER

    traced = [r for r in runs if r.get("kernels")]
    if not traced:
        return []
    source = "device kernels" if traced[0]["kernels"]["source"] == "cuda" else "operators' self time (a CPU)"
    lines = ["", f"Kernel time by category, seconds per traced step ({source}; share of their sum; "
             "tools/kernel_categories.py):", "",
             "| model | seq | variant | " + " | ".join(ORDER) + " | sum s | first of other |",
             "|" + "---|" * (len(ORDER) + 5)]
    for r in traced:
        k = r["kernels"]
        other = next((t["name"] for t in k["top"] if t["category"] == "other"), "-")
        lines.append(f"| {r['model']} | {r['seq']} | {r['variant']} | "
                     + " | ".join(f"{k['seconds'][c]:.3f} ({k['share'][c]:.0%})" for c in ORDER)
                     + f" | {k['total_s']:.3f} | {other[:60].replace('|', '/')} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's own)")
    p.add_argument("--seq", default="64", help="comma-separated sequence lengths")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=4, help="the planner's fallback micro-batch")
    p.add_argument("--variant", default="planner", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up (event breakdown; the "
                                                        "protocol's steady state asks for >= 5)")
    p.add_argument("--traced", type=int, default=2, help="steps under torch.profiler (0: none)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--no-clip", action="store_true", help="no gradient clipping (the planner may then choose eager)")
    p.add_argument("--planner-only", action="store_true", help="skip a configuration the planner finds no plan for")
    p.add_argument("--trace-dir", default=None, help="write each configuration's Chrome trace here")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    try:
        models = [m for m in args.model.split(",") if m]
        seqs = [int(s) for s in args.seq.split(",") if s]
        variants = [v for v in args.variant.split(",") if v]
        for v in variants:
            if v not in VARIANTS:
                raise ValueError(f"--variant {v!r} is unknown; use one of {', '.join(VARIANTS)}")
        if args.steps < 1 or min(args.traced, args.warmup) < 0:
            raise ValueError("--steps must be >= 1, --traced and --warmup >= 0")
        machine = probe.describe(args.device)
        specs = [RunSpec("megatrain", model_label(m, args.layers), model_config(m, args.layers, s), s, args.batch,
                         args.micro_batch, args.warmup + args.steps, warmup=args.warmup, device=machine["device"])
                 for m in models for s in seqs]
    except ValueError as e:
        print(f"step_anatomy: {e}", file=sys.stderr)
        return 2
    import_megatrain()
    echo = lambda text: print(text, flush=True)  # noqa: E731
    from megatrain.planner.profiling.profiler import detect

    hw = detect()
    args.matmul_peak_tflops = machine["matmul_peak"]["tflops"]
    date = datetime.date.today().isoformat()
    rep = {"benchmark": "step_anatomy", "date": date, "device": report.device_label(machine), "machine": machine,
           "command": "python benchmarks/step_anatomy.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "runs": []}
    os.makedirs(args.out, exist_ok=True)
    base = new_base(os.path.join(args.out, f"{date}_{rep['device']}_step_anatomy_{'-'.join(models)}"))
    def write(runs: list[dict[str, Any]]) -> str:
        """The report with ``runs``, both files (rewritten as each configuration ends, and before its trace)."""
        with open(base + ".json", "w") as f:
            json.dump({**rep, "runs": runs}, f, indent=1)
        md = markdown({**rep, "runs": runs})
        with open(base + ".md", "w") as f:
            f.write(md)
        return md

    for spec in specs:
        for v in variants:
            # a run stopped by its time limit keeps the rows it measured, and a traced row its timed steps
            rep["runs"].append(measure(spec, v, args, hw, echo, keep=lambda row: write(rep["runs"] + [row])))
            md = write(rep["runs"])
    print(md)
    print(f"wrote {base}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
