"""``megatrain-train`` against plain PyTorch and PyTorch with per-layer checkpointing, each a process per run.

    python benchmarks/own_loop_cli.py --model 25m --seq 128 --batch 4 --steps 10 --rounds 5    # on a CPU (fp32)

The command-line path of ``benchmarks/own_loop.py`` (which times ``Engine`` in one process): each round runs, in a
rotating order, ``megatrain-train`` as a user would (the model's config.json with ``--init random --seed 0``, the
planner's plan, ``--compute-dtype fp32 --progress none --no-plot``) and this file as a child running
``own_loop.pytorch_trainer`` plain, with every decoder layer checkpointed, and plain in a process that keeps its
freed heap as ``megatrain-train``'s does ([Note: freed heap] in runtime/device/host_heap.py), on the same token
rows (a 2-D .npy, ``--packing none --no-shuffle``: one row per sequence, in file order), from the same initial weights
(``Engine(config, seed=0)``'s, as the command line builds them) with the command line's AdamW (betas 0.9/0.95,
weight decay 0.1 except norms and biases, clipping 1.0) at a constant learning rate (``--warmup-steps 0
--min-lr`` = ``--lr``). Step times: ``megatrain-train``'s ``step_time_s`` in its metrics.jsonl (the time from one
step's end to the next's, the batch's assembly included); the child times its steps the same way (from the
previous step's end, batch slicing included, to the loss's ``.item()``). The first ``--warmup`` steps of every run
are dropped; process start, planning and the final checkpoint are outside every step. Per round and system: the
median of the run's remaining steps; the per-round ratio is that over PyTorch's median in the same round. Losses
are compared step by step with PyTorch's (equal to about 1e-5 in fp32). The load average is recorded around
every run. Writes ``benchmarks/results/<date>_<device>_own_loop_cli_<model>.{json,md}`` (and a .png with
matplotlib).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from own_loop import MODELS, pytorch_trainer, result_rows, write_results  # noqa: E402
from result_files import machine  # noqa: E402

SYSTEMS = ("megatrain-train", "pytorch", "pytorch, per-layer checkpointing", "pytorch, freed heap kept")
CHILD = {"pytorch": "plain", "pytorch, per-layer checkpointing": "checkpoint", "pytorch, freed heap kept": "heap"}
LR = 1e-4


def cli_command(args, config_json: str, data: str, out: str) -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "megatrain-train")
    return [exe, "--model", config_json, "--init", "random", "--seed", "0", "--data", data, "--packing", "none",
            "--no-shuffle", "--seq-len", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps),
            "--lr", str(LR), "--min-lr", str(LR), "--warmup-steps", "0", "--compute-dtype", "fp32",
            "--device", "cpu", "--progress", "none", "--no-plot", "--out", out, "--overwrite"]


def child(args) -> int:
    """One PyTorch run (``--child plain|checkpoint|heap``): per-step seconds and losses as JSON to ``--child-out``.
    ``heap``: plain, in a process that keeps its freed heap as ``megatrain-train``'s does (``keep_freed_heap``)."""
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the reference model of the equivalence tests
    from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, keep_freed_heap

    if args.child == "heap" and not keep_freed_heap():
        raise SystemExit("this C library has no mallopt: drop the freed-heap row")

    config = ModelConfig(**MODELS[args.model])
    optimizer = OptimizerConfig(lr=LR, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0,
                                no_decay=("norm", "bias"))  # megatrain-train's defaults (tools/train.py)
    with Engine(config, optimizer=optimizer, compute_dtype=torch.float32, device=torch.device("cpu"), seed=0) as engine:
        state = engine.state_dict()
    step = pytorch_trainer(config, optimizer, state, torch.device("cpu"), checkpoint=args.child == "checkpoint")
    rows = torch.from_numpy(np.load(args.data))
    seconds, losses = [], []
    last = time.perf_counter()
    for i in range(args.steps):
        losses.append(step(rows[i * args.batch:(i + 1) * args.batch], lr=LR))
        now = time.perf_counter()
        seconds.append(now - last)
        last = now
    with open(args.child_out, "w") as f:
        json.dump({"seconds": seconds, "losses": losses}, f)
    return 0


def run(system: str, args, config_json: str, data: str, work: str) -> dict:
    """One run of ``system``: its per-step seconds and losses, and the load average around it."""
    out = os.path.join(work, "run")
    if system == "megatrain-train":
        cmd = cli_command(args, config_json, data, out)
    else:
        cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--seq", str(args.seq),
               "--batch", str(args.batch), "--steps", str(args.steps), "--data", data,
               "--child", CHILD[system], "--child-out", out + ".json"]
    before = os.getloadavg()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    after = os.getloadavg()
    if system == "megatrain-train":
        with open(os.path.join(out, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
        result = {"seconds": [r["step_time_s"] for r in records], "losses": [r["loss"] for r in records]}
    else:
        with open(out + ".json") as f:
            result = json.load(f)
    return {**result, "load_before": before, "load_after": after}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="25m")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps of every run left out of its median")
    p.add_argument("--rounds", type=int, default=5, help="runs of each system")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--label", default="", help="appended to the results' file names (keeps another run's files)")
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--child", choices=("plain", "checkpoint", "heap"), help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    cfg = MODELS[args.model]
    with tempfile.TemporaryDirectory(prefix="own_loop_cli_") as work:
        config_json = os.path.join(work, "config.json")
        from megatrain.runtime import ModelConfig

        config = ModelConfig(**cfg)
        with open(config_json, "w") as f:
            json.dump(dict(config.to_dict(), model_type="llama"), f)
        data = os.path.join(work, "tokens.npy")
        gen = np.random.default_rng(0)
        np.save(data, gen.integers(0, cfg["vocab_size"], (args.steps * args.batch, args.seq), dtype=np.int64))
        runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
        for r in range(args.rounds):
            for system in SYSTEMS[r % len(SYSTEMS):] + SYSTEMS[:r % len(SYSTEMS)]:  # rotate who goes first
                runs[system].append(run(system, args, config_json, data, work))
                last = runs[system][-1]
                print(f"round {r + 1}/{args.rounds} {system}: median step "
                      f"{statistics.median(last['seconds'][args.warmup:]):.3f} s, last loss {last['losses'][-1]:.6f},"
                      f" load {last['load_before'][0]:.1f} -> {last['load_after'][0]:.1f}", file=sys.stderr,
                      flush=True)
    medians = {s: [statistics.median(x["seconds"][args.warmup:]) for x in runs[s]] for s in SYSTEMS}
    gaps = {s: max(abs(a - b) for x, y in zip(runs[s], runs["pytorch"]) for a, b in zip(x["losses"], y["losses"]))
            for s in SYSTEMS}
    rows = [dict(row, max_loss_difference_to_pytorch=gaps[row["system"]])
            for row in result_rows(medians, {s: runs[s][-1]["losses"][-1] for s in SYSTEMS})]
    loads = [x["load_before"][0] for s in SYSTEMS for x in runs[s]] + [x["load_after"][0] for s in SYSTEMS
                                                                       for x in runs[s]]
    info = machine()
    cli = " ".join(["megatrain-train"] + cli_command(args, "CONFIG.json", "TOKENS.npy", "OUT")[1:])
    report = {"date": datetime.date.today().isoformat(), "machine": info, "threads": torch.get_num_threads(),
              "args": vars(args),
              "params": int(sum(v.numel() for v in _shapes(cfg))), "model": cfg, "results": rows,
              "runs": runs, "megatrain_train_command": cli,
              "command": f"python benchmarks/own_loop_cli.py --model {args.model} --seq {args.seq} "
                         f"--batch {args.batch} --steps {args.steps} --warmup {args.warmup} --rounds {args.rounds}"
                         + (f" --label {args.label}" if args.label else "")}
    notes = [f"{args.rounds} rounds; each round one run per system in a fresh process (rotating order), {args.steps} "
             f"steps a run of which the first {args.warmup} are dropped; a system's figure per round is its run's "
             f"median step, and the ratio is per round against PyTorch's run. megatrain-train's step time is the "
             f"`step_time_s` of its metrics.jsonl. 1-minute load average around the runs {min(loads):.1f} to "
             f"{max(loads):.1f} (every run's before and after in the .json). "
             f"Largest loss difference to PyTorch at any step: "
             + ", ".join(f"{r['system']} {r['max_loss_difference_to_pytorch']:.1e}" for r in rows) + ".", "",
             f"megatrain-train ran as `{report['megatrain_train_command']}`."]
    write_results(args, "own_loop_cli", "cpu", "megatrain-train vs PyTorch", report, notes)
    return 0


def _shapes(cfg: dict) -> list[torch.Tensor]:
    """The model's parameters on the meta device (their count, without allocating them)."""
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from reference_model import ReferenceLM

    from megatrain.runtime import ModelConfig

    with torch.device("meta"):
        return list(ReferenceLM(ModelConfig(**cfg)).parameters())


if __name__ == "__main__":
    sys.exit(main())
