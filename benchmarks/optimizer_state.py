"""Loss curves of fp32 vs bf16 AdamW state (megatrain-train's demo), against the run-to-run noise of two seeds.

    python benchmarks/optimizer_state.py --steps 100 --out benchmarks/results
    python benchmarks/optimizer_state.py --model config.json --label 100m --batch 4 --seq-len 128   # another model

Runs the demo four times (fp32 and bf16 state, seeds 0 and 1; two at a time, one thread each) and compares
the per-step losses: |bf16 - fp32| at the same seed against |seed 0 - seed 1| at the same state dtype.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import tempfile

from result_files import write_report


def run(state: str, seed: int, steps: int, root: str, extra: list[str]) -> subprocess.Popen:
    out = os.path.join(root, f"{state}-{seed}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(["megatrain-train", "--steps", str(steps), "--seed", str(seed), "--optimizer-state",
                             state, "--out", out, "--progress", "none", "--no-plot", "--save-every", "0", *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def losses(root: str, state: str, seed: int) -> list[float]:
    with open(os.path.join(root, f"{state}-{seed}", "metrics.jsonl"), encoding="utf-8") as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r and "step" in r and "eval_loss" not in r]


def window_mean(xs: list[float], k: int = 10) -> float:
    return statistics.fmean(xs[-k:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--model", default=None, help="megatrain-train --model (default: the demo model)")
    p.add_argument("--label", default=None, help="the model's name in the result files (with --model)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    args = p.parse_args()
    extra = [*(["--model", args.model] if args.model else []), *(["--batch", str(args.batch)] if args.batch else []),
             *(["--seq-len", str(args.seq_len)] if args.seq_len else [])]
    label = args.label or ("demo" if args.model is None else os.path.basename(args.model))
    root = tempfile.mkdtemp(prefix="optimizer-state-")
    curves = {}
    for pair in ((("fp32", 0), ("bf16", 0)), (("fp32", 1), ("bf16", 1))):
        procs = [(key, run(*key, args.steps, root, extra)) for key in pair]
        for key, proc in procs:
            _, err = proc.communicate()
            if proc.returncode:
                raise SystemExit(f"{key} failed: {err.decode()[-400:]}")
            curves[f"{key[0]}-seed{key[1]}"] = losses(root, *key)
    n = min(len(c) for c in curves.values())

    def gap(a: str, b: str) -> dict[str, float]:
        d = [abs(x - y) for x, y in zip(curves[a][:n], curves[b][:n])]
        return {"mean_abs": statistics.fmean(d), "max_abs": max(d),
                "last10_mean_diff": window_mean(curves[a][:n]) - window_mean(curves[b][:n])}

    result = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["python benchmarks/optimizer_state.py --steps", str(args.steps), *extra]),
        "model": label, "steps": n,
        "state_gap": {s: gap(f"bf16-seed{s}", f"fp32-seed{s}") for s in (0, 1)},
        "seed_noise": {d: gap(f"{d}-seed0", f"{d}-seed1") for d in ("fp32", "bf16")},
        "last10_mean_loss": {k: window_mean(v[:n]) for k, v in curves.items()},
        "curves": curves,
    }
    suffix = "" if label == "demo" else f"_{label}"
    lines = [f"# fp32 vs bf16 AdamW state: {label} loss curves, {n} steps ({result['date']}, shared CPU)", "",
             f"`{result['command']}`", "", "| comparison | mean abs loss diff | max abs | last-10 mean diff |",
             "|---|---|---|---|"]
    for label, g in [*((f"bf16 vs fp32 state, seed {s}", result["state_gap"][s]) for s in (0, 1)),
                     *((f"seed 0 vs seed 1, {d} state", result["seed_noise"][d]) for d in ("fp32", "bf16"))]:
        lines.append(f"| {label} | {g['mean_abs']:.4f} | {g['max_abs']:.4f} | {g['last10_mean_diff']:+.4f} |")
    lines += ["", "Last-10-step mean loss: " + ", ".join(f"{k} {v:.4f}" for k, v in
                                                       result["last10_mean_loss"].items())]
    write_report(os.path.join(args.out, f"{result['date']}_cpu_optimizer_state{suffix}"), result, lines, indent=1)


if __name__ == "__main__":
    main()
