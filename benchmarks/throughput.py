"""Throughput: megatrain against plain in-memory PyTorch training of the same model, in one run.

    python benchmarks/throughput.py --model 1b --seq 2048 --batch 32 --micro-batch 8     # on a GPU
    python benchmarks/throughput.py --model tiny --seq 128 --batch 8 --steps 4           # on a CPU

Each system runs in a fresh subprocess (so peak memory is its own) with the same
random initial weights and batches: megatrain (bf16 compute on a GPU, fp32 on a
CPU; weights and AdamW state in host memory) and PyTorch with the whole model on
the device (fp32 master, bf16 autocast on a GPU, per-layer activation
checkpointing only where the model does not fit without it, ``peer_runners/fits.py``, fused AdamW on
the device). Step times are intervals between step ends (benchmarks/README.md, steady state). Reports per system: median step time with
the min and max of the timed steps after the warm-up, tokens/s, model TFLOP/s without attention
(6 x N_matmul x tokens / step time; recompute not counted; ``flop_figures``, benchmarks/README.md)
with the every-parameter figure beside it, and with causal attention's forward and backward FLOPs
by the model convention added (``ModelShape.attention_model_flops_per_token``), MFU against the
device's datasheet bf16 peak where known, peak device memory, peak host RSS, final loss; and
megatrain / PyTorch as a ratio.
Writes ``benchmarks/results/<date>_<device>_throughput.{json,md}``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the reference model of the equivalence tests
sys.path.insert(0, HERE)

from result_files import machine, write_report  # noqa: E402

MODELS = {
    # Llama-3.2-1B's shape (1.24B parameters, tied embeddings).
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0),
    "tiny": dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
}


def batches(vocab: int, batch: int, seq: int, steps: int):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(steps)]


def run_megatrain(args, cfg, device) -> dict:
    from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.plan == "planner":  # what a user's run gets: the planner's search for this batch on this machine
        from peer_runners.run_megatrain import planner_plan

        plan, _ = planner_plan(dict(cfg, model_type="llama"), args.seq, args.batch, device.type, args.micro_batch)
    else:  # --plan manual: every layer recomputed from its checkpoint
        plan = Plan(micro_batch_size=args.micro_batch, num_slots=args.slots, prefetch_depth=args.slots - 1,
                    checkpoints=args.checkpoints, loss_chunk_tokens=args.loss_chunk)
    engine = Engine(ModelConfig(**cfg), OptimizerConfig(lr=1e-4, max_grad_norm=1.0), plan=plan,
                    compute_dtype=dtype, device=device, seed=0)
    times, losses = [], []
    t_prev = time.perf_counter()
    for i, ids in enumerate(batches(cfg["vocab_size"], args.batch, args.seq, args.steps)):
        losses.append(engine.step(ids, ids).item())  # .item(): the step's end, as a user's loop would see it
        # a step's time: the interval between two step ends (its deferred AdamW lands in the step it delays)
        now = time.perf_counter()
        times.append(now - t_prev)
        t_prev = now
        print(f"  megatrain step {i + 1}/{args.steps}: {times[-1]:.3f} s, loss {losses[-1]:.4f}", file=sys.stderr,
              flush=True)
    engine.synchronize()
    n = engine.num_parameters
    engine.close()
    return {"times": times, "loss": losses[-1], "losses": losses, "params": n, "compute_dtype": str(dtype),
            "plan": plan.to_dict()}


def run_pytorch(args, cfg, device) -> dict:
    from reference_model import ReferenceLM

    from megatrain.runtime import Engine, ModelConfig
    from megatrain.runtime.model.head_loss import shift_labels

    config = ModelConfig(**cfg)
    init = Engine(config, device="cpu", seed=0)  # the same initial weights as megatrain's
    model = ReferenceLM(config)
    model.load_state_dict(init.state_dict())
    init.close()
    model.to(device)
    # activation checkpointing only where the model does not fit without it (peers' estimate, peer_runners/fits.py)
    from megatrain.planner.shapes import model_shapes
    from peer_runners import fits

    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    checkpoint, why = fits.choose_checkpointing(model_shapes.from_config(dict(cfg, model_type="llama")),
                                                args.micro_batch * args.seq, memory)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    times, losses = [], []
    t_prev = time.perf_counter()
    for i, ids in enumerate(batches(cfg["vocab_size"], args.batch, args.seq, args.steps)):
        ids = ids.to(device)
        labels = shift_labels(ids)
        n_tokens = (labels != -100).sum()
        total = torch.zeros((), device=device)
        for s in range(0, ids.shape[0], args.micro_batch):
            with autocast:
                logits = model(ids[s:s + args.micro_batch], checkpoint=checkpoint)
            part = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels[s:s + args.micro_batch].flatten(),
                                                     ignore_index=-100, reduction="sum") / n_tokens
            part.backward()
            total += part.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total.item())
        now = time.perf_counter()
        times.append(now - t_prev)
        t_prev = now
        print(f"  pytorch step {i + 1}/{args.steps}: {times[-1]:.3f} s, loss {losses[-1]:.4f}", file=sys.stderr,
              flush=True)
    return {"times": times, "loss": losses[-1], "losses": losses, "params": sum(p.numel() for p in model.parameters()),
            "activation_checkpointing": why}


def child(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    cfg = MODELS[args.model]
    try:
        out = (run_megatrain if args.child == "megatrain" else run_pytorch)(args, cfg, device)
        out["status"] = "ok"
    except torch.OutOfMemoryError as e:  # recorded, with its peak, not fatal to the comparison
        out = {"status": f"out of memory: {str(e).splitlines()[0]}"}
    out["peak_device_bytes"] = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    out["peak_host_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["device"] = str(device)
    print(json.dumps(out))


def summarize(name: str, r: dict, tokens: int, warmup: int, shape, seq: int, gpu: str | None) -> dict:
    """One system's row: step time (median, min, max of the steps after ``warmup``) and the protocol's FLOP
    figures (``flop_figures``) for a model of ``shape`` on rows of ``seq`` tokens."""
    from flop_figures import figures

    if r.get("status") != "ok":
        return {"system": name, **r}
    steady = r["times"][warmup:] or r["times"]
    step = statistics.median(steady)
    return {"system": name, "status": "ok", "step_seconds": step, "min_step_seconds": min(steady),
            "max_step_seconds": max(steady), "timed_steps": len(steady), "tokens_per_second": tokens / step,
            **figures(shape, tokens, step, seq, gpu_name=gpu),
            "final_loss": r["loss"], "losses": r["losses"], "plan": r.get("plan"),
            "peak_device_gib": None if r["peak_device_bytes"] is None else r["peak_device_bytes"] / 2**30,
            "peak_host_rss_gib": r["peak_host_rss_bytes"] / 2**30, "params": r["params"], "step_times": r["times"],
            **({"activation_checkpointing": r["activation_checkpointing"]} if "activation_checkpointing" in r else {})}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--plan", choices=["planner", "manual"], default="planner",
                   help="megatrain's plan: the planner's (default), or --micro-batch, --slots, --checkpoints and "
                        "--loss-chunk with every layer recomputed")
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--checkpoints", choices=["device", "host"], default="device")
    p.add_argument("--loss-chunk", type=int, default=4096)
    p.add_argument("--steps", type=int, default=6, help="steps, the warm-up included (default 6: 1 + 5 timed)")
    p.add_argument("--warmup", type=int, default=1, help="steps left out of the median")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA exists")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--child", choices=["megatrain", "pytorch"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0

    from megatrain.planner.shapes import model_shapes

    tokens = args.batch * args.seq
    shape = model_shapes.from_config(dict(MODELS[args.model], model_type="llama"))
    info = machine()
    rows = []
    for system in ("pytorch", "megatrain"):
        print(f"{system}: {args.model}, {args.batch} x {args.seq} tokens, {args.steps} steps", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--child", system] + [a for a in sys.argv[1:]]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        result = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {
            "status": f"failed with exit status {proc.returncode}"}
        rows.append(summarize(system, result, tokens, args.warmup, shape, args.seq,
                              None if args.cpu else info.get("gpu")))
    base, ours = rows
    ratio = (ours["tokens_per_second"] / base["tokens_per_second"]
             if ours.get("status") == "ok" and base.get("status") == "ok" else None)
    device = (info.get("gpu") or "cpu").replace(" ", "-")
    if args.cpu:
        device = "cpu"
    report = {"date": datetime.date.today().isoformat(), "machine": info, "args": vars(args),
              "command": "python benchmarks/throughput.py" + "".join(f" {a}" for a in sys.argv[1:]), "results": rows,
              "megatrain_over_pytorch_tokens_per_second": ratio}
    lines = [f"# Throughput, {args.model}, {args.batch} x {args.seq} tokens/step, {device} ({report['date']})", "",
             "| system | step s (min-max) | tokens/s | model TFLOP/s (6 N_matmul, attention not counted) "
             "| all-param TFLOP/s | with attention | MFU (datasheet) | peak device GiB | peak host RSS GiB "
             "| final loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['system']} | {r['status']} | | | | | | | | |")
            continue
        dev = "-" if r["peak_device_gib"] is None else f"{r['peak_device_gib']:.2f}"
        mfu = "-" if r["mfu_datasheet"] is None else (f"{r['mfu_datasheet']:.1%} of "
                                                      f"{r['datasheet_peak']['device']}")
        lines.append(f"| {r['system']} | {r['step_seconds']:.3f} ({r['min_step_seconds']:.3f}-"
                     f"{r['max_step_seconds']:.3f}, {r['timed_steps']} timed) | {r['tokens_per_second']:,.0f} | "
                     f"{r['model_tflops']:.3f} | {r['all_params_tflops']:.3f} | {r['model_tflops_with_attention']:.3f} "
                     f"| {mfu} | {dev} | {r['peak_host_rss_gib']:.2f} | {r['final_loss']:.4f} |")
    if ours.get("plan"):
        p = ours["plan"]
        lines += ["", f"megatrain's plan ({args.plan}): {p['micro_batch_size']} sequences a micro-batch, "
                  f"{p['num_slots']} slots, checkpoints on the {p['checkpoints']}, {len(p['kept_layers'])} of "
                  f"{MODELS[args.model]['num_hidden_layers']} layers kept, AdamW {p['optimizer_mode']}."]
    if base.get("activation_checkpointing"):
        lines += ["", f"PyTorch's activation checkpointing: {base['activation_checkpointing']}."]
    if all(r.get("status") == "ok" for r in rows):
        gaps = [abs(a - b) for a, b in zip(base["losses"], ours["losses"])]
        lines += ["", f"Losses, step by step, megatrain against PyTorch: largest difference {max(gaps):.2e} "
                  f"(step {gaps.index(max(gaps)) + 1} of {len(gaps)})."]
    if ratio is not None:
        lines += ["", f"megatrain / PyTorch tokens/s: **{ratio:.2f}x** (6 N_matmul per token; recompute not counted)"]
    write_report(os.path.join(args.out, f"{report['date']}_{device}_throughput_{args.model}"), report, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
