"""The README's own-loop example against plain PyTorch: ``Engine(config)`` with no plan, step for step.

    python benchmarks/own_loop.py --model 25m --seq 128 --batch 4 --rounds 12     # on a CPU (fp32)
    python benchmarks/own_loop.py --model 100m --rounds 10 --systems 0,1,3,5   # ~100M, fewer systems

(``benchmarks/own_loop_cli.py`` times the same model through ``megatrain-train``, a process per run.)
One process holds up to six trainers of the same model from the same initial weights: megatrain as the README's
"Train from your own loop" builds it (no plan: the default plan, whose micro-batch the first step sets to the
batch and which keeps the layers whose activations fit: [Note: kept layers]), megatrain with that micro-batch
but every layer recomputed from its checkpoint (``Plan(micro_batch_size=batch)``: the default before layers were
kept), megatrain with ``Plan()`` (one sequence per micro-batch, the default before it took the batch),
megatrain with the plan ``megatrain-train`` would run (``plan_request.choose_plan`` on this machine's profile),
plain PyTorch (the equivalence tests' reference model, no activation checkpointing, fused ``torch.optim.AdamW``,
global-norm clipping: ``pytorch_trainer``), and the same with each decoder layer under ``torch.utils.checkpoint``
(``use_reentrant=False``: its forward recomputed in backward, as megatrain's recomputed layers); ``--systems``
picks which (only those are built). Each round runs one step of each, in a rotating order, on the same batch, so
the ratios of adjacent steps hold little of a shared machine's drift. A megatrain step is timed to its loss's
``.item()`` and its deferred AdamW update (``engine.synchronize()``; ``--no-wait`` leaves the update to run into
the next system's step). PyTorch's step is slower here than in a process of its own (7-15% on this CPU):
``own_loop_cli.py``'s process-per-run ratios are the fair ones. Reports median step seconds, the median of
the per-round ratios to PyTorch, and the last losses (equal to about 1e-6 in fp32).
Writes ``benchmarks/results/<date>_<device>_own_loop_<model>.{json,md}`` (and a .png with matplotlib).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from result_files import machine, write_report  # noqa: E402
from throughput import MODELS as THROUGHPUT_MODELS, batches  # noqa: E402

MODELS = {
    **THROUGHPUT_MODELS,
    # 25.8M parameters: 6 layers of h512 (GQA 8/4 heads), vocabulary 8192, untied.
    "25m": dict(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                num_attention_heads=8, num_key_value_heads=4),
    # 100.7M parameters: 12 layers of h768 (GQA 12/4 heads), vocabulary 16384, untied.
    "100m": dict(vocab_size=16384, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4),
}
SYSTEMS = ("megatrain, no plan", "megatrain, every layer recomputed", "megatrain, Plan()", "megatrain, planner's plan",
           "pytorch", "pytorch, per-layer checkpointing")


def pytorch_trainer(config, optimizer, state: dict, device: torch.device, checkpoint: bool = False):
    """Plain PyTorch training of the model from ``state``: ``step(ids, lr=None) -> loss`` (float).

    The equivalence tests' reference model (one autograd graph, full logits), fused ``torch.optim.AdamW`` with
    ``optimizer``'s hyper-parameters and decay groups, global-norm clipping; ``checkpoint``: each decoder layer
    under ``torch.utils.checkpoint`` (``use_reentrant=False``), its forward recomputed in backward.
    """
    from reference_model import ReferenceLM, make_optimizer

    from megatrain.runtime.model.head_loss import IGNORE_INDEX, shift_labels

    model = ReferenceLM(config)
    model.load_state_dict(state)
    model.to(device)
    opt = make_optimizer(model, optimizer)

    def step(ids: torch.Tensor, lr: float | None = None) -> float:
        if lr is not None:
            for group in opt.param_groups:
                group["lr"] = lr
        ids = ids.to(device)
        logits = model(ids, checkpoint=checkpoint)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), shift_labels(ids).flatten(),
                                                 ignore_index=IGNORE_INDEX)
        loss.backward()
        if optimizer.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), optimizer.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _megatrain_step(engine, ids: torch.Tensor, wait: bool) -> float:
    """One step; ``wait``: and its deferred AdamW update, which the AdamW worker thread otherwise runs on after
    ``step`` returns, so that no system's step pays for work another left behind."""
    loss = engine.step(ids, ids).item()
    if wait:
        engine.synchronize()
    return loss


def trainers(cfg: dict, device: torch.device, seq: int, batch: int, systems: tuple[str, ...], wait: bool = True):
    """A step function per system of ``systems``, each from the same initial weights: ``step(ids) -> loss``; the
    default plan, the planner's plan and the parameter count. Only the systems asked for are built (at ~100M each
    trainer holds ~1.6 GB of weights and AdamW state)."""
    from megatrain.planner.shapes import model_shapes
    from megatrain.planner.choice.plan_request import PlanRequest, choose_plan
    from megatrain.planner.profiling.profiler import this_machine
    from megatrain.planner.shapes.workload import Workload
    from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan

    config = ModelConfig(**cfg)
    optimizer = OptimizerConfig(lr=1e-4, max_grad_norm=1.0)
    work = Workload(seq, batch, compute_dtype="fp32", clipping=True)
    shape = model_shapes.from_config(dict(cfg, model_type="llama"))
    planned = choose_plan(shape, PlanRequest(work), this_machine()).plan
    own = Engine(config, optimizer=optimizer, compute_dtype=torch.float32, device=device)  # the README's example
    state = own.state_dict()  # every other trainer starts from these weights (the Engines: the same seed)
    plans = {SYSTEMS[1]: Plan(micro_batch_size=batch), SYSTEMS[2]: Plan(), SYSTEMS[3]: planned}
    engines = {SYSTEMS[0]: own, **{s: Engine(config, optimizer=optimizer, plan=plan, compute_dtype=torch.float32,
                                            device=device) for s, plan in plans.items() if s in systems}}
    steps = {s: (lambda e: lambda ids: _megatrain_step(e, ids, wait))(e) for s, e in engines.items()}
    for s, checkpoint in ((SYSTEMS[4], False), (SYSTEMS[5], True)):
        if s in systems:
            steps[s] = pytorch_trainer(config, optimizer, state, device, checkpoint=checkpoint)
    return steps, list(engines.values()), planned, own.num_parameters


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="25m")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="rounds left out of the medians")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA exists")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--systems", default=",".join(str(i) for i in range(len(SYSTEMS))),
                   help="comma-separated numbers of the systems to run, of " +
                   "; ".join(f"{i}: {s}" for i, s in enumerate(SYSTEMS)) + " (PyTorch always runs)")
    p.add_argument("--label", default="", help="appended to the results' file names (keeps another run's files)")
    p.add_argument("--no-wait", action="store_true",
                   help="time megatrain's steps to the loss only: their deferred AdamW runs on into the next "
                        "system's step (how results before 2026-11-26 were taken)")
    p.add_argument("--keep-freed-heap", action="store_true",
                   help="call megatrain.runtime.keep_freed_heap() first, as the README's own loop does (the process's "
                        "setting: every system, PyTorch too, runs with it)")
    args = p.parse_args()
    if args.keep_freed_heap:
        from megatrain.runtime import keep_freed_heap

        keep_freed_heap()
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the reference model of the equivalence tests
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    cfg = MODELS[args.model]
    chosen = tuple(SYSTEMS[int(i)] for i in args.systems.split(",") if SYSTEMS[int(i)] != "pytorch") + ("pytorch",)
    steps, engines, planned, params = trainers(cfg, device, args.seq, args.batch, chosen, wait=not args.no_wait)
    data = batches(cfg["vocab_size"], args.batch, args.seq, args.rounds)
    load_before = os.getloadavg()  # a shared machine: how busy it was, for reading the spread
    seconds: dict[str, list[float]] = {s: [] for s in chosen}
    losses: dict[str, list[float]] = {s: [] for s in chosen}
    for r, ids in enumerate(data):
        order = chosen[r % len(chosen):] + chosen[:r % len(chosen)]  # rotate who goes first
        for system in order:
            t0 = time.perf_counter()
            losses[system].append(steps[system](ids))  # .item() inside: the step's end, as a loop sees it
            if r >= args.warmup:
                seconds[system].append(time.perf_counter() - t0)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{s} {losses[s][-1]:.6f}" for s in chosen),
              file=sys.stderr, flush=True)
    plan = engines[0].plan  # the default plan, as the first step set it
    for engine in engines:
        engine.close()
    rows = result_rows(seconds, {s: losses[s][-1] for s in chosen})
    info = machine()
    device_name = "cpu" if device.type == "cpu" else (info.get("gpu") or "gpu").replace(" ", "-")
    report = {"date": datetime.date.today().isoformat(), "machine": info, "threads": torch.get_num_threads(),
              "args": vars(args), "params": params,
              "model": cfg, "default_plan_micro_batch_size": plan.micro_batch_size,
              "default_plan": plan.to_dict(), "planner_plan": planned.to_dict(), "results": rows,
              "seconds": seconds, "losses": losses,
              "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
              "command": f"python benchmarks/own_loop.py --model {args.model} --seq {args.seq} --batch {args.batch} "
                         f"--rounds {args.rounds} --systems {args.systems}" + (" --cpu" if args.cpu else "")
                         + (" --no-wait" if args.no_wait else "") + (f" --label {args.label}" if args.label else "")
                         + (" --keep-freed-heap" if args.keep_freed_heap else "")}
    waited = "" if args.no_wait else " and, for megatrain, to the end of its deferred AdamW update"
    notes = [f"{args.rounds - args.warmup} rounds after {args.warmup} warm-up, one step of each system per round "
             f"(rotating order, one process; each step timed from its call to its loss's ``.item()``{waited}); load "
             f"average {load_before[0]:.1f} before and {report['load_average_1_5_15_min']['after'][0]:.1f} after "
             f"(1 min). The default plan took micro-batch {plan.micro_batch_size} from the first step and keeps "
             f"{len(plan.kept_layers)} of {cfg['num_hidden_layers']} layers; the planner's plan has "
             f"micro-batch {planned.micro_batch_size}, {planned.num_slots} slots, checkpoints on "
             f"{planned.checkpoints}, {len(planned.kept_layers)} layers kept."]
    write_results(args, "own_loop", device_name, "The README's own loop vs PyTorch", report, notes)
    return 0


def result_rows(seconds: dict[str, list[float]], last_loss: dict[str, float]) -> list[dict]:
    """Per system: the median and least of its ``seconds`` (one per round) and the median of its per-round ratios
    to ``seconds["pytorch"]``."""
    return [{"system": s, "median_step_s": statistics.median(t), "min_step_s": min(t),
             "median_ratio_to_pytorch": statistics.median(a / b for a, b in zip(t, seconds["pytorch"])),
             "final_loss": last_loss[s]} for s, t in seconds.items()]


def write_results(args, name: str, device_name: str, heading: str, report: dict, notes: list[str]) -> None:
    """``<out>/<date>_<device>_<name>_<model>[_<label>]``: .json (``report``), .md (``heading``, the command,
    ``notes``, a table of ``report["results"]``) and .png (the median ratios to PyTorch; with matplotlib)."""
    rows = report["results"]
    title = f"{args.model} ({report['params'] / 1e6:.1f}M), {args.batch} x {args.seq} tokens/step, fp32, {device_name}"
    info = report["machine"]
    lines = [f"# {heading}, {title} ({report['date']})", "", f"`{report['command']}`", "",
             f"{info['cores']} cores ({info['cpu']}), torch {info['torch']}, {report['threads']} threads per process "
             f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}).", *notes, ""]
    lines = lines + ["| system | median step s | min step s | median of per-round ratios to PyTorch | last loss |",
                     "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['median_step_s']:.3f} | {r['min_step_s']:.3f} | "
                     f"{r['median_ratio_to_pytorch']:.2f}x | {r['final_loss']:.6f} |")
    stem = write_report(os.path.join(args.out, f"{report['date']}_{device_name}_{name}_{args.model}"
                                     + (f"_{args.label}" if args.label else "")), report, lines)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.45 * len(rows)))
    ax.barh([r["system"] for r in rows], [r["median_ratio_to_pytorch"] for r in rows])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("median per-round step time / PyTorch's")
    ax.set_title(f"{heading}, {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=120)
    plt.close(fig)
    print(f"plot: {stem}.png", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
