"""The spill read-ahead's depth on a small spilled model: the step, the disk's busy and exposed time, against
the planner's figures for the same plans.

    python benchmarks/spill_read_ahead.py --dir /path/on/nvme [--staging 1,3,0] [--steps 3] [--rounds 2]

One model (Llama-shaped, h512, 8 layers, vocab 16384: 35M parameters, fp32 on the CPU, everything spilled with
1 MiB chunks, so the embedding is 32 chunks and a layer 12) runs with each staging depth (0: the planner's
choice for this disk and the RAM left, of ``spill_choices.SPILL_STAGING``), the depths interleaved round by round,
each run in this process one after another; the last ``--steps`` steps after a warm-up are kept. Beside each: the
cost model's step and the read-ahead it expects (``spill_timing``) with the saved profile
($MEGATRAIN_HARDWARE or ``megatrain-plan profile --spill-dir DIR``'s). The load average is recorded: on a shared
machine the figures are noisy. Writes ``benchmarks/results/<date>_cpu_spill_read_ahead.{json,md}``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

import torch

from result_files import write_report

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = dict(model_type="llama", vocab_size=16384, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=4)
SEQ, BATCH, CHUNK = 256, 2, 1 << 20


def run(staging: int, steps: int, spill_dir: str) -> list[dict[str, float]]:
    from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan

    plan = Plan(spill="all", spill_dir=spill_dir, spill_staging=staging, spill_chunk_bytes=CHUNK,
                micro_batch_size=BATCH, loss_chunk_tokens=BATCH * SEQ)
    out = []
    gen = torch.Generator().manual_seed(0)
    with Engine(ModelConfig.from_hf(CONFIG), OptimizerConfig(lr=1e-4, max_grad_norm=1.0), plan=plan,
                compute_dtype=torch.float32, device="cpu", seed=0) as engine:
        for i in range(steps + 1):
            ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=gen)
            engine.time_next_step()
            engine.step(ids, ids).item()
            if i:
                out.append(dict(engine.last_step_breakdown or {}))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--dir", required=True, help="a folder on the disk to spill to")
    p.add_argument("--staging", default="1,3,0", help="staging depths (0: the planner's)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    from megatrain.planner.costs import cost_model
    from megatrain.planner.shapes import model_shapes
    from megatrain.planner.choice import search, sizing
    from megatrain.plan.plan import Plan
    from megatrain.planner.profiling.profiler import this_machine
    from megatrain.planner.shapes.workload import Workload

    hw, _ = sizing.with_disk(this_machine())
    shape = model_shapes.from_config(CONFIG)
    work = Workload(SEQ, BATCH, "fp32", clipping=True, spill="all", spill_dir=args.dir)
    chosen = search.search(shape, work, hw).require().plan.spill_staging
    depths = list(dict.fromkeys(chosen if int(s) == 0 else int(s) for s in args.staging.split(",")))
    load = [os.getloadavg()]
    measured: dict[int, list[dict[str, float]]] = {d: [] for d in depths}
    for r in range(args.rounds):
        for d in depths:
            print(f"round {r + 1}/{args.rounds}: staging {d}", file=sys.stderr, flush=True)
            measured[d] += run(d, args.steps, args.dir)
            load.append(os.getloadavg())
    rows = []
    for d in depths:
        plan = Plan(spill="all", spill_dir=args.dir, spill_staging=d, spill_chunk_bytes=CHUNK, micro_batch_size=BATCH,
                    loss_chunk_tokens=BATCH * SEQ)
        est = cost_model.estimate(shape, work, plan, hw)
        med = {k: statistics.median(s.get(k, 0.0) for s in measured[d])
               for k in ("step_s", "compute_s", "disk_busy_s", "disk_exposed_s", "disk_adam_exposed_s")}
        rows.append({"staging": d, "planner_choice": d == chosen, "predicted_step_s": est.step_seconds,
                     "predicted_disk_s": est.disk_seconds, **{f"median_{k}": v for k, v in med.items()},
                     "steps": measured[d]})
    today = datetime.date.today().isoformat()
    command = "python benchmarks/spill_read_ahead.py" + "".join(f" {a}" for a in sys.argv[1:])
    report = {"date": today, "command": command, "load_average": load, "hardware": hw.to_dict(), "rows": rows}
    lines = [f"# Spill read-ahead depth, 35M spilled model, CPU ({today})", "", f"`{command}`; load average "
             f"(1 min) {min(x[0] for x in load):.1f} .. {max(x[0] for x in load):.1f} over the run: the machine "
             "was shared, figures are noisy.", "",
             "| staging sets | planner's | step s (median) | compute s | disk busy s | disk exposed s | of it AdamW's "
             "| predicted step s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['staging']} | {'yes' if r['planner_choice'] else ''} | {r['median_step_s']:.3f} | "
                     f"{r['median_compute_s']:.3f} | {r['median_disk_busy_s']:.3f} | "
                     f"{r['median_disk_exposed_s']:.3f} | {r['median_disk_adam_exposed_s']:.3f} | "
                     f"{r['predicted_step_s']:.3f} |")
    write_report(os.path.join(args.out, f"{today}_cpu_spill_read_ahead"), report, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
