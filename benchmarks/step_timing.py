"""What the step's timing costs: untimed and timed steps of this tree, and a baseline revision's step, in one run.

    python benchmarks/step_timing.py --model tiny --seq 128 --batch 8 --baseline d1ed77f      # on a CPU
    python benchmarks/step_timing.py --model 1b --seq 2048 --batch 16 --micro-batch 4       # on a GPU

This tree's engine alternates untimed steps and steps asked for with ``engine.time_next_step()``
(same process, same batches), so their ratio holds no process-to-process noise. With
``--baseline REV``, the same steps also run on revision REV of this repository (extracted with
``git archive`` into a temporary directory and imported from there, in its own processes),
alternating process by process with this tree's for ``--rounds`` rounds; a revision from before
timing was opt-in times every step. Reports median step seconds and the ratios.
Writes ``benchmarks/results/<date>_<device>_step_timing_<model>.{json,md}``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from throughput import MODELS, batches  # noqa: E402
from result_files import machine, write_report  # noqa: E402


def child(args) -> None:
    """One engine, ``--steps`` steps after ``--warmup``: alternately untimed and (where it can) timed.

    Per step: its seconds and how many times the step timer read its clock (on a CPU it times with
    the clock; on CUDA it records events at the same places)."""
    import torch

    import megatrain.runtime as runtime
    from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan
    from megatrain.runtime.pipeline import step_timer

    reads = [0]
    clock = time.perf_counter

    def counted() -> float:
        reads[0] += 1
        return clock()

    step_timer.time = types.SimpleNamespace(perf_counter=counted)  # the timer's clock only

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = MODELS[args.model]
    plan = Plan(micro_batch_size=args.micro_batch, num_slots=args.slots, prefetch_depth=args.slots - 1)
    data = batches(cfg["vocab_size"], args.batch, args.seq, 2)
    opt_in = hasattr(Engine, "time_next_step")
    steps: list[tuple[str, float, int]] = []  # (kind, seconds, timer clock reads)
    with Engine(ModelConfig(**cfg), OptimizerConfig(lr=1e-4, max_grad_norm=1.0), plan=plan, compute_dtype=dtype,
                device=device, seed=0) as engine:
        for i in range(args.warmup + args.steps):
            kind = ("timed" if i % 2 else "untimed") if opt_in else "always timed"
            if kind == "timed":
                engine.time_next_step()
            ids = data[(i // 2) % 2]  # each batch once untimed and once timed
            reads[0] = 0
            t0 = time.perf_counter()
            engine.step(ids, ids).item()  # .item(): the step's end, as a training loop sees it
            if i >= args.warmup:
                steps.append((kind, time.perf_counter() - t0, reads[0]))
        engine.synchronize()
    pairs = [b[1] / a[1] for a, b in zip(steps, steps[1:]) if (a[0], b[0]) == ("untimed", "timed")]
    print(json.dumps({"steps": steps, "pairs": pairs, "runtime": os.path.dirname(runtime.__file__), "device": str(device)}))


def extract(rev: str, into: str) -> str:
    """Revision ``rev`` of this repository as an importable ``megatrain`` package under ``into``."""
    src = os.path.join(into, "src")
    os.makedirs(src)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True, stdout=subprocess.PIPE).stdout
    subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
    pkg = os.path.join(into, "pkg", "megatrain")
    shutil.copytree(os.path.join(src, "megatrain"), pkg)
    for sub in ("runtime", "planner", "tools"):  # the package-dir mapping of pyproject.toml
        os.symlink(os.path.join(src, sub), os.path.join(pkg, sub))
    return os.path.dirname(pkg)


def run_child(args, pythonpath: str | None) -> dict:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *sys.argv[1:]]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=HERE)
    if proc.returncode != 0:
        raise SystemExit(f"a benchmark process failed with exit status {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--steps", type=int, default=12, help="measured steps per process (half of them timed)")
    p.add_argument("--warmup", type=int, default=2, help="steps before the measured ones, per process")
    p.add_argument("--rounds", type=int, default=3, help="processes per tree, alternating with the baseline's")
    p.add_argument("--baseline", metavar="REV", help="a git revision of this repository to compare against")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA exists")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0

    systems: dict[str, list[tuple[str, float, int]]] = {}
    runtimes: dict[str, str] = {}
    pairs: list[float] = []  # timed / untimed of adjacent steps in one process: least touched by other load
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"this tree": None}
        if args.baseline:
            paths[f"baseline {args.baseline}"] = extract(args.baseline, tmp)
        for r in range(args.rounds):
            for name, path in paths.items():
                print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                out = run_child(args, path)
                runtimes[name] = out["runtime"]
                systems.setdefault(name, []).extend(tuple(x) for x in out["steps"])
                pairs += out["pairs"]
    device = out["device"]
    rows = []
    for name, steps in systems.items():
        for kind in dict.fromkeys(k for k, _, _ in steps):
            ts = [t for k, t, _ in steps if k == kind]
            q1, _, q3 = statistics.quantiles(ts, n=4)
            rows.append({"system": name, "steps": kind, "n": len(ts), "median_s": statistics.median(ts),
                         "min_s": min(ts), "iqr_s": q3 - q1,
                         "timer_clock_reads_per_step": sorted({c for k, _, c in steps if k == kind})})
    median = {(r["system"], r["steps"]): r["median_s"] for r in rows}
    ratios = {"timed / untimed, median of adjacent pairs (this tree)": statistics.median(pairs),
              "timed / untimed, medians (this tree)": median[("this tree", "timed")] / median[("this tree", "untimed")]}
    if args.baseline:
        base = median[(f"baseline {args.baseline}", "always timed")]
        ratios[f"untimed / baseline {args.baseline}, medians"] = median[("this tree", "untimed")] / base
        ratios[f"timed / baseline {args.baseline}, medians"] = median[("this tree", "timed")] / base
    info = machine()
    label = "cpu" if device == "cpu" else (info.get("gpu") or device).replace(" ", "-")
    report = {"date": datetime.date.today().isoformat(), "machine": info, "device": device, "args": vars(args),
              "runtimes": runtimes, "results": rows, "ratios": ratios}
    lines = [f"# Step timing cost, {args.model}, {args.batch} x {args.seq} tokens/step, micro-batch "
             f"{args.micro_batch}, {label} ({report['date']})", "",
             f"{args.rounds} processes per tree, {args.steps} measured steps each after {args.warmup} warm-up; "
             f"{info.get('cores')} cores ({info.get('cpu')}), torch {info.get('torch')}.", "",
             "| system | steps | n | median s | min s | interquartile range s | timer clock reads per step |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['system']} | {r['steps']} | {r['n']} | {r['median_s']:.4f} | {r['min_s']:.4f} | {r['iqr_s']:.4f} "
              f"| {', '.join(map(str, r['timer_clock_reads_per_step']))} |" for r in rows]
    lines += [""] + [f"- {k}: **{v:.3f}x**" for k, v in ratios.items()]
    write_report(os.path.join(args.out, f"{report['date']}_{label}_step_timing_{args.model}"), report, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
