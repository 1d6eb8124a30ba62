"""The NVMe tier at scale: how large a Llama-shaped model trains here with spill, and how fast.

    flock /tmp/megatrain-bigmem.lock python benchmarks/spill_scale.py --dir /work/spill --model 1b,3b --steps 2

For each model (Llama-3.2-1B and -3B shapes, vocab 128256, fp32 on a CPU) and each spill choice it runs
one subprocess (its RSS its own): builds the Engine with ``spill="all"`` (or the ``--spill`` given;
``--spill planner``: the plan search's per-block placement, RAM up to ``--ram-gib`` filled first),
records resident bytes after init and the peak, bytes on disk, the disk bytes read and written per step
(``/proc/self/io`` rchar / wchar), and times ``--steps`` steps with ``last_step_breakdown``. Beside it: the
planner's memory prediction for the same plan, and the step against max(compute, disk bytes / measured
disk bandwidth) (the saved profile, ``$MEGATRAIN_HARDWARE`` or ``megatrain-plan profile --spill-dir DIR``'s).
AdamW clips at 1.0 unless ``--no-clip``; ``--eager`` (with it) updates each block in backward whatever mode the
planner would choose. The plan is the search's whole (slots, micro-batch, kept layers, loss chunk: what
``megatrain-train`` runs) with the spill placement, staging and chunk asked for; ``--recompute-all`` keeps no
layer (every layer recomputed in backward, as these runs did before 2026-11-28).
Writes ``benchmarks/results/<date>_cpu_spill_scale_<spill>_<models>[_no_clip][_eager][_recompute_all]``
``.{json,md}`` (``_2``, ``_3``, ... after it where a run that day took the name).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from result_files import machine, write_report  # noqa: E402

LLAMA = dict(vocab_size=128256, num_attention_heads=32, rope_theta=500000.0)
MODELS = {
    # Llama-3.2-1B: 1.24B parameters; -3B: 3.21B (24 heads, 8 KV heads, head_dim 128); both tied.
    "1b": dict(LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_key_value_heads=8,
               tie_word_embeddings=True),
    "3b": dict(LLAMA, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, tie_word_embeddings=True),
}


def model_config(name: str) -> dict:
    """``1b`` / ``3b``, or ``llama-HIDDENxLAYERS``: a Llama-3-shaped model of one of the planner's widths
    (``sizing.LLAMA_WIDTHS``), as ``megatrain-plan``'s largest-model line names it."""
    if name in MODELS:
        return MODELS[name]
    from megatrain.planner.choice.sizing import LLAMA_WIDTHS

    hidden, layers = (int(x) for x in name.removeprefix("llama-").split("x"))
    width = next(w for w in LLAMA_WIDTHS if w[0] == hidden)
    return dict(LLAMA, hidden_size=hidden, intermediate_size=width[1], num_attention_heads=width[2],
                num_key_value_heads=width[3], tie_word_embeddings=width[4], num_hidden_layers=layers)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _io() -> tuple[int, int]:
    with open("/proc/self/io") as f:
        d = dict(line.split(": ") for line in f.read().splitlines())
    return int(d["rchar"]), int(d["wchar"])


def child(args) -> dict:
    from megatrain.planner.costs import cost_model, memory_model, spill_placement
    from megatrain.planner.shapes import model_shapes
    from megatrain.planner.profiling.profiler import this_machine
    from megatrain.planner.shapes.workload import Workload
    from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan

    cfg = model_config(args.model)
    shape = model_shapes.from_config({"model_type": "llama", **cfg})
    state = args.optimizer_state
    clipping = not args.no_clip
    work = Workload(seq_len=args.seq, batch=args.batch, compute_dtype="fp32", clipping=clipping, optimizer_state=state)
    spill, blocks = args.spill, None
    from megatrain.planner.choice import search, sizing

    hw, _ = sizing.with_disk(this_machine())
    if spill == "planner":  # the search's plan: RAM (up to --ram-gib) first, the disk with the rest
        if args.ram_gib:
            hw = hw.replace(host_available_bytes=int(args.ram_gib * 2**30), cgroup_limit_bytes=0)
        free = shutil.disk_usage(args.dir).free
        if args.disk_gb:
            free = min(free, int(args.disk_gb * 1e9))
        planned = search.search(shape, Workload(args.seq, args.batch, "fp32", clipping=clipping, spill_dir=args.dir,
                                                spill_free_bytes=free, optimizer_state=state), hw).require().plan
        spill, blocks = planned.spill, planned.spill_blocks
    elif spill != "none":  # the search's plan for this placement: read-ahead depth, chunk, kept layers
        planned = search.search(shape, Workload(args.seq, args.batch, "fp32", clipping=clipping, spill=spill,
                                                spill_dir=args.dir, optimizer_state=state), hw).require().plan
    # The searched plan whole (its slots, micro-batch, kept layers, loss chunk, I/O modes: what megatrain-train
    # runs), with the staging and chunk given; with ``--spill planner`` its memory fits --ram-gib only with its
    # own staging and chunk. ``--recompute-all``: no layer kept, every one recomputed in backward.
    args.staging = max(1, args.staging if args.staging > 0 or spill == "none" else planned.spill_staging)
    chunk = (args.chunk_mib * 2**20 if args.chunk_mib else
             planned.spill_chunk_bytes if spill != "none" else Plan().spill_chunk_bytes)
    args.chunk_mib = chunk / 2**20
    if spill == "none":
        plan = Plan(spill_chunk_bytes=chunk, optimizer_mode="eager" if args.eager else "deferred")
    else:
        plan = planned.replace(spill=spill, spill_blocks=blocks, spill_dir=args.dir, spill_staging=args.staging,
                               spill_chunk_bytes=chunk, optimizer_mode="eager" if args.eager else planned.optimizer_mode)
    if args.recompute_all:
        plan = plan.replace(kept_layers=())
    print(f"  placement: {spill_placement.label(plan)}", file=sys.stderr, flush=True)
    est = memory_model.estimate(shape, work, plan, this_machine())
    predicted_step_s = cost_model.estimate(shape, work, plan, this_machine()).step_seconds
    probes = [_probe(args.dir, shape, work, plan)] if args.probe_disk else []
    rss0 = _rss()
    t0 = time.perf_counter()
    engine = Engine(ModelConfig(**cfg), OptimizerConfig(lr=1e-4, max_grad_norm=1.0 if clipping else None,
                                                        state_dtype=state), plan=plan,
                    compute_dtype=torch.float32, device="cpu", seed=0)
    init_s = time.perf_counter() - t0
    rss_init = _rss()
    print(f"  init {init_s:.1f} s, RSS {rss_init / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    gen = torch.Generator().manual_seed(0)
    steps = []
    # Steps back to back, as a training loop runs them (the deferred updates and writes behind of one step
    # overlap the next): a step's wall time and disk bytes are from one step's return to the next's, so
    # from the second step on they are the steady state's.
    r0, w0 = _io()
    t = time.perf_counter()
    for i in range(args.steps):
        ids = torch.randint(0, cfg["vocab_size"], (args.batch, args.seq), generator=gen)
        engine.time_next_step()
        loss = engine.step(ids, ids).item()
        now = time.perf_counter()
        wall, t = now - t, now
        r1, w1 = _io()
        bd = engine.last_step_breakdown or {}
        steps.append({"wall_s": wall, "loss": loss, "read_bytes": r1 - r0, "written_bytes": w1 - w0, **bd})
        r0, w0 = r1, w1
        print(f"  step {i + 1}/{args.steps}: {wall:.1f} s, loss {loss:.4f}, read {steps[-1]['read_bytes'] / 1e9:.1f} GB, "
              f"written {steps[-1]['written_bytes'] / 1e9:.1f} GB", file=sys.stderr, flush=True)
    engine.synchronize()
    out = {"model": args.model, "params": engine.num_parameters, "spill": args.spill, "optimizer_state": state,
           "clipping": clipping,
           "placement": spill_placement.label(plan), "plan": plan.to_dict(), "seq": args.seq,
           "batch": args.batch, "staging": args.staging, "chunk_mib": args.chunk_mib, "init_s": init_s,
           "rss_before_engine_bytes": rss0, "rss_after_init_bytes": rss_init, "nvme_bytes": engine.store.nvme_bytes,
           "store_host_bytes": engine.store.nbytes, "steps": steps,
           "predicted_host_bytes": est.host_bytes + est.device_bytes, "predicted_nvme_bytes": est.nvme_bytes,
           "predicted_step_s": predicted_step_s}
    engine.close()
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if args.probe_disk:
        out["disk_probes"] = probes + [_probe(args.dir, shape, work, plan)]
    return out


def _probe(directory: str, shape, work, plan) -> dict:
    """The disk as ``megatrain-plan profile`` measures it, now, and the planner's step for ``plan`` at those
    figures (the rest of the saved profile unchanged)."""
    from megatrain.planner.costs import cost_model
    from megatrain.planner.profiling.host_probe import disk_bandwidth
    from megatrain.planner.profiling.profiler import this_machine

    read, write, _ = disk_bandwidth(directory)
    hw = this_machine().replace(disk_read_gbps=read, disk_write_gbps=write)
    print(f"  disk now: read {read:.2f} / write {write:.2f} GB/s", file=sys.stderr, flush=True)
    return {"read_gbps": read, "write_gbps": write,
            "predicted_step_s": cost_model.estimate(shape, work, plan, hw).step_seconds}


def markdown(rows: list[dict], info: dict) -> str:
    lines = [f"# Spill at scale ({info['date']}, {info['machine']['cores']} cores, "
             f"{info['machine']['host_ram_gib']} GiB RAM, fp32 on the CPU)", "",
             "| model | params | spill | RSS after init | peak RSS | planner host | bytes/param resident | "
             "NVMe | bytes/param on disk | step | read / written per step | disk time | compute | "
             "step / max(compute, disk) | disk busy / exposed |", "|" + "---|" * 15]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['model']} | | {r['spill']} | {r.get('status')} |" + " |" * 11)
            continue
        s = r["steps"][-1]
        read_gbps, write_gbps = _disk_rates(r, info)
        disk = s["read_bytes"] / (read_gbps * 1e9) + s["written_bytes"] / (write_gbps * 1e9)
        comp = s.get("compute_s", float("nan"))
        lines.append(
            f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r.get('placement', r['spill'])} | "
            f"{r['rss_after_init_bytes'] / 2**30:.2f} GiB | "
            f"{r['peak_rss_bytes'] / 2**30:.2f} GiB | {r['predicted_host_bytes'] / 2**30:.2f} GiB | "
            f"{r['peak_rss_bytes'] / r['params']:.2f} | {r['nvme_bytes'] / 1e9:.1f} GB | "
            f"{r['nvme_bytes'] / r['params']:.1f} | {s['wall_s']:.1f} s | {s['read_bytes'] / 1e9:.1f} / "
            f"{s['written_bytes'] / 1e9:.1f} GB | {disk:.1f} s | {comp:.1f} s | {s['wall_s'] / max(comp, disk):.2f}x | "
            f"{s.get('disk_busy_s', float('nan')):.1f} / {s.get('disk_exposed_s', float('nan')):.1f} s |")
    for r in rows:
        if r.get("status") == "ok":
            plan, layers = r["plan"], model_config(r["model"])["num_hidden_layers"]
            lines += ["", f"{r['model']}: {plan['optimizer_mode']} updates, {len(plan['kept_layers'])} of {layers} "
                          f"layers kept (the rest recomputed in backward), {plan['spill_staging']} staging sets of "
                          f"{plan['spill_chunk_bytes'] / 2**20:.0f} MiB, micro-batch {plan['micro_batch_size']}"]
        if r.get("status") == "ok" and "predicted_step_s" in r:
            p, m = r["predicted_step_s"], r["steps"][-1]["wall_s"]
            lines += ["", f"{r['model']}: the planner's step {p:.1f} s against {m:.1f} s measured ({p / m - 1:+.0%})"]
        for when, probe in zip(("before", "after"), r.get("disk_probes", ())):
            p, m = probe["predicted_step_s"], r["steps"][-1]["wall_s"]
            lines += ["", f"{r['model']}: at the disk's figures measured just {when} the steps (read "
                          f"{probe['read_gbps']:.2f} / write {probe['write_gbps']:.2f} GB/s) the planner's step is "
                          f"{p:.1f} s ({p / m - 1:+.0%})"]
        s = r["steps"][-1] if r.get("status") == "ok" else {}
        if "disk_busy_forward_s" in s:  # the halves of the step (the forward with the previous step's update)
            fwd, busy = s["forward_s"], s["disk_busy_forward_s"]
            back, back_busy = s["step_s"] - fwd, s["disk_busy_s"] - busy
            lines += ["", f"{r['model']}: disk busy {busy:.1f} s of the forward half's {fwd:.1f} s "
                          f"({busy / fwd:.0%}), {back_busy:.1f} s of the backward half's {back:.1f} s "
                          f"({back_busy / back:.0%})"]
    lines += ["", f"disk bandwidth used for 'disk time': read {info['read_gbps']:.2f} GB/s, write "
                  f"{info['write_gbps']:.2f} GB/s (megatrain-plan profile's figures for this disk, or --read-gbps / "
                  "--write-gbps), or with --probe-disk the mean of the figures measured just before and after the "
                  "steps.", ""]
    return "\n".join(lines)


def _disk_rates(row: dict, info: dict) -> tuple[float, float]:
    """(read, write) GB/s for a row's disk time: its probes' mean where it has them, else the run's figures."""
    probes = row.get("disk_probes")
    if not probes:
        return info["read_gbps"], info["write_gbps"]
    return (sum(p["read_gbps"] for p in probes) / len(probes), sum(p["write_gbps"] for p in probes) / len(probes))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="1b", help="comma-separated: " + ", ".join(MODELS) +
                   ", or llama-HIDDENxLAYERS (a width of the planner's largest-model answer)")
    p.add_argument("--spill", default="all", choices=["none", "optimizer", "all", "planner"],
                   help="what spills; planner: the plan search's per-block placement for this RAM and disk")
    p.add_argument("--ram-gib", type=float, default=None, help="--spill planner: the RAM the search may fill "
                                                                 "(default: what this machine has available)")
    p.add_argument("--disk-gb", type=float, default=None, help="--spill planner: the disk space (GB) the search "
                                                                  "may fill (default: what is free under --dir)")
    p.add_argument("--dir", required=False, default=None, help="spill directory (on the disk to measure)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--staging", type=int, default=0,
                   help="spill staging sets (0: the planner's choice for this disk and the RAM left)")
    p.add_argument("--chunk-mib", type=int, default=0,
                   help="spill chunk MiB (default: the searched plan's: a layer's bytes, at most 64 MiB)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--optimizer-state", choices=["fp32", "bf16"], default="fp32",
                   help="AdamW m and v's dtype, in RAM and in spill files")
    p.add_argument("--read-gbps", type=float, default=None)
    p.add_argument("--write-gbps", type=float, default=None)
    p.add_argument("--no-clip", action="store_true", help="no gradient clipping (the planner's plan for that)")
    p.add_argument("--eager", action="store_true",
                   help="with --no-clip: eager updates (each in backward), whatever the planner's mode")
    p.add_argument("--recompute-all", action="store_true",
                   help="keep no layer's activations: every layer recomputed in backward (the runs before 2026-11-28)")
    p.add_argument("--probe-disk", action="store_true",
                   help="measure the disk (megatrain-plan profile's probe) just before and after the steps, and "
                        "give the planner's step for the same plan at those figures")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if args.eager and not args.no_clip:
        p.error("--eager needs --no-clip: with clipping an update waits for the whole backward's norm")
    if args.spill != "none" and not args.dir:
        p.error("--dir names the spill directory (a local disk with room for the spill files)")
    from megatrain.planner.profiling.profiler import this_machine

    hw = this_machine()  # $MEGATRAIN_HARDWARE or the saved profile: the disk's measured GB/s
    info = {"date": datetime.date.today().isoformat(),
            "machine": {**machine(), "disk_free_gb": round(shutil.disk_usage(args.dir or ".").free / 1e9, 1)},
            "read_gbps": args.read_gbps or hw.disk_read_gbps or 1.0,
            "write_gbps": args.write_gbps or hw.disk_write_gbps or 1.0}
    rows = []
    for model in args.model.split(","):
        print(f"{model}, spill={args.spill}:", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--child", "--model", model, "--spill", args.spill, "--seq", str(args.seq),
               "--batch", str(args.batch), "--staging", str(args.staging), "--chunk-mib", str(args.chunk_mib),
               "--steps", str(args.steps), "--optimizer-state", args.optimizer_state] + (
                   ["--no-clip"] if args.no_clip else []) + (["--eager"] if args.eager else []) + (
                   ["--dir", args.dir] if args.dir else []) + (
                   ["--ram-gib", str(args.ram_gib)] if args.ram_gib else []) + (
                   ["--disk-gb", str(args.disk_gb)] if args.disk_gb else []) + (
                   ["--probe-disk"] if args.probe_disk else []) + (["--recompute-all"] if args.recompute_all else [])
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if proc.returncode == 0:
            rows.append({"status": "ok", **json.loads(proc.stdout.strip().splitlines()[-1])})
        else:
            rows.append({"model": model, "spill": args.spill, "status": f"failed (exit {proc.returncode})"})
    base = os.path.join(args.out, f"{info['date']}_cpu_spill_scale_{args.spill}_{args.model.replace(',', '_')}"
                        + ("_bf16_state" if args.optimizer_state == "bf16" else "")
                        + ("_no_clip" if args.no_clip else "") + ("_eager" if args.eager else "")
                        + ("_recompute_all" if args.recompute_all else ""))
    write_report(base, {**info, "rows": rows}, markdown(rows, info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
