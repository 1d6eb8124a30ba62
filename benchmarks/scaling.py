"""Data-parallel scaling: tokens/s at world size 1, 2, 4, at a fixed global batch and at a fixed per-rank batch,
with the planner's predictions beside.

    python benchmarks/scaling.py                       # CPU ranks (gloo) on this machine, the tiny model
    python benchmarks/scaling.py --worlds 1,2,4,8 --model 1b --seq 2048 --global-batch 16   # GPUs (one per rank)

Each configuration starts its ranks (torch.multiprocessing, spawn; a gloo group over a file store, or NCCL with
GPUs), runs ``--warmup`` steps then ``--steps`` timed steps between barriers, and records global tokens/s, each
rank's peak RSS and its host store's bytes. CPU ranks share the machine's cores (each gets cores / W threads),
which the planner models the same way. Writes ``benchmarks/results/<date>_<device>_scaling.{json,md,png}``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import pickle
import resource
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from throughput import MODELS as THROUGHPUT_MODELS, batches  # noqa: E402
from result_files import figure, machine, write_report  # noqa: E402

# "33m": a model whose host state dominates a CPU rank's RSS (16 B/param, 0.5 GiB at one rank), for the memory rows.
MODELS = {**THROUGHPUT_MODELS,
          "33m": dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4)}


LOAD_BEFORE = "unknown"


def rank_main(rank: int, world: int, store: str, args: argparse.Namespace, rank_batch: int, out: str) -> None:
    import datetime as dt

    import torch.distributed as dist

    from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan

    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=dt.timedelta(seconds=300))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    plan = Plan(micro_batch_size=args.micro_batch, num_slots=2, prefetch_depth=1)
    engine = Engine(ModelConfig(**MODELS[args.model]), OptimizerConfig(lr=1e-4, max_grad_norm=1.0), plan=plan,
                    compute_dtype=torch.bfloat16 if cuda else torch.float32, device=device, seed=0)
    data = batches(MODELS[args.model]["vocab_size"], rank_batch, args.seq, args.warmup + args.steps)
    for ids in data[:args.warmup]:
        engine.step(ids, ids).item()
    dist.barrier()
    start = time.perf_counter()
    for ids in data[args.warmup:]:
        loss = engine.step(ids, ids)
    loss.item()
    engine.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - start
    result = {"rank": rank, "seconds": seconds, "store_bytes": engine.store.nbytes,
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    engine.close()
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def measure(args: argparse.Namespace, world: int, rank_batch: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="megatrain-scaling-") as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=rank_main, args=(r, world, os.path.join(tmp, "store"), args, rank_batch, tmp))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(args.timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        ranks = []
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                raise SystemExit(f"scaling: rank {r} of {world} failed (exit code {procs[r].exitcode})")
            with open(path, "rb") as f:
                ranks.append(pickle.load(f))
    seconds = max(r["seconds"] for r in ranks)
    tokens = world * rank_batch * args.seq * args.steps
    return {"world": world, "rank_batch": rank_batch, "global_batch": world * rank_batch,
            "tokens_per_second": tokens / seconds, "step_seconds": seconds / args.steps,
            "store_bytes": [r["store_bytes"] for r in ranks], "peak_rss_bytes": [r["peak_rss_bytes"] for r in ranks]}


def predict(args: argparse.Namespace, world: int, rank_batch: int) -> dict:
    from megatrain.planner.costs import data_parallel
    from megatrain.planner.shapes import model_shapes
    from megatrain.plan.plan import Plan
    from megatrain.planner.profiling.profiler import this_machine
    from megatrain.planner.shapes.workload import Workload

    hw = this_machine()
    cuda = torch.cuda.is_available() and not args.cpu
    model = model_shapes.from_config({**MODELS[args.model], "model_type": "llama"}, name=args.model)
    work = Workload(args.seq, world * rank_batch, "bfloat16" if cuda else "float32")
    plan = Plan(micro_batch_size=args.micro_batch, num_slots=2, prefetch_depth=1)
    topo = data_parallel.topology(hw, world, 1)
    s = data_parallel.scaling(model, work, plan, hw, topo)
    mem = data_parallel.memory(model, work, plan, hw, topo)
    state = sum(c.nbytes for c in mem.components if c.name in data_parallel.STATE_COMPONENTS)
    # What one rank's peak RSS should be: its host buffers, and on a CPU its device buffers too.
    rank = mem.host_bytes + (mem.device_bytes if hw.device_is_host else 0)
    return {"tokens_per_second": s.tokens_per_second, "step_seconds": s.step_seconds, "comm_seconds": s.comm_seconds,
            "state_bytes": state, "rank_bytes": rank, "components": mem.rows(), "bandwidth": topo.source,
            "hardware": hw.source}


def main() -> int:
    global LOAD_BEFORE
    LOAD_BEFORE = _loadavg()[1]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=sorted(MODELS))
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8, help="the fixed global batch (a multiple of every world)")
    p.add_argument("--rank-batch", type=int, default=4, help="the fixed per-rank batch")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--worlds", default="1,2,4")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--cpu", action="store_true", help="CPU ranks even with GPUs")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--modes", default="fixed global batch,fixed per-rank batch")
    args = p.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    modes = args.modes.split(",")
    rows = []
    for mode in modes:
        for w in worlds:
            rank_batch = args.global_batch // w if mode == "fixed global batch" else args.rank_batch
            print(f"scaling: {mode}, world {w}, {rank_batch} sequences per rank ...", file=sys.stderr, flush=True)
            row = {"mode": mode, **measure(args, w, rank_batch), "predicted": predict(args, w, rank_batch)}
            print(f"  {row['tokens_per_second']:,.0f} tok/s measured, {row['predicted']['tokens_per_second']:,.0f} "
                  f"predicted", file=sys.stderr, flush=True)
            rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["mode"] == row["mode"] and r["world"] == worlds[0])
        row["speedup"] = row["tokens_per_second"] / base["tokens_per_second"]
        row["predicted"]["speedup"] = row["predicted"]["tokens_per_second"] / base["predicted"]["tokens_per_second"]
    device = "gpu" if torch.cuda.is_available() and not args.cpu else "cpu"
    report = {"date": datetime.date.today().isoformat(), "machine": machine(), "device": device, "args": vars(args),
              "loadavg": _loadavg(), "results": rows}
    lines = [f"# Data-parallel scaling ({device}, {args.model}, seq {args.seq}, {args.steps} timed steps)", "",
             f"Machine: {report['machine']}", "",
             f"Load average (1, 5, 15 min) before / after: {report['loadavg'][0]} / {report['loadavg'][1]}", "",
             "| batch | world | per-rank batch | tokens/s | speed-up | predicted tokens/s | predicted speed-up "
             "| store MiB per rank | predicted state MiB | peak RSS MiB per rank | predicted MiB per rank "
             "| measured / predicted |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q = r["predicted"]
        peaks = r["peak_rss_bytes"]
        lines.append(f"| {r['mode']} | {r['world']} | {r['rank_batch']} | {r['tokens_per_second']:,.0f} | "
                     f"{r['speedup']:.2f}x | {q['tokens_per_second']:,.0f} | {q['speedup']:.2f}x | "
                     f"{max(r['store_bytes']) / 2**20:.1f} | {q['state_bytes'] / 2**20:.1f} | "
                     f"{', '.join(f'{b / 2**20:.0f}' for b in peaks)} | {q['rank_bytes'] / 2**20:.0f} | "
                     f"{min(peaks) / q['rank_bytes']:.2f}-{max(peaks) / q['rank_bytes']:.2f} |")
    lines += ["", f"Planner: {rows[-1]['predicted']['bandwidth']}; hardware {rows[-1]['predicted']['hardware']}.",
              f"Command: `python benchmarks/scaling.py {' '.join(sys.argv[1:])}`".rstrip()]
    stem = write_report(os.path.join(args.out, f"{report['date']}_{device}_scaling"), report, lines, indent=1)
    print(f"plot: {plot(rows, stem + '.png')}", file=sys.stderr)
    return 0


def _loadavg() -> list[str]:
    try:
        with open("/proc/loadavg") as f:
            now = " ".join(f.read().split()[:3])
    except OSError:
        now = "unknown"
    return [LOAD_BEFORE, now]


def plot(rows: list[dict], path: str) -> str:
    def draw(ax) -> None:
        for mode, marker in (("fixed global batch", "o"), ("fixed per-rank batch", "s")):
            sel = [r for r in rows if r["mode"] == mode]
            if not sel:
                continue
            worlds = [r["world"] for r in sel]
            ax.plot(worlds, [r["tokens_per_second"] for r in sel], marker + "-", label=f"{mode}: measured")
            ax.plot(worlds, [r["predicted"]["tokens_per_second"] for r in sel], marker + "--", label=f"{mode}: planner")
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel("tokens/s")
        ax.legend()

    return figure(path, (7, 4), draw)


if __name__ == "__main__":
    sys.exit(main())
