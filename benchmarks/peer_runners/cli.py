"""The command line of ``benchmarks/peers.py`` (its docstring is the help)."""
from __future__ import annotations

import argparse
import os
import sys
import time

from .spec import MODELS, SYSTEMS

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _list(kind, choices=None):
    def parse(text: str) -> list:
        items = [kind(x) for x in text.split(",") if x.strip()]
        bad = [x for x in items if choices is not None and x not in choices]
        if bad or not items:
            of = ", ".join(choices or ["numbers"])
            raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list of {of}")
        return items
    return parse


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="tiny", help="model shape (default tiny)")
    p.add_argument("--layers", type=int, help="decoder layers instead of the shape's own")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step (global batch)")
    p.add_argument("--micro-batch", type=int, default=2,
                   help="sequences per micro-batch of the peers (megatrain takes its plan's)")
    p.add_argument("--steps", type=int, default=6,
                   help="timed optimizer steps per system, warm-up included (default 6: 1 warm-up + 5, the "
                        "protocol's least); one more runs untimed after them")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the median")
    p.add_argument("--systems", type=_list(str, SYSTEMS), default=list(SYSTEMS),
                   help=f"comma-separated, of {','.join(SYSTEMS)} (default all)")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: CUDA when there is one")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the token batches")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (every system; default 3e-4)")
    p.add_argument("--out", default=os.path.join(HERE, "results"),
                   help="folder of the report (default benchmarks/results)")
    p.add_argument("--logs", help="folder for each run's output (default: a temporary folder, printed)")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs of today's report for this device; run what it lacks or did not run "
                        "(out of time, DeepSpeed not installed then)")
    p.add_argument("--retry-failed", action="store_true",
                   help="with --resume: run again the runs that failed (out-of-memory results stay)")
    p.add_argument("--time-budget", type=float,
                   help="seconds for the whole comparison (default: none; 900 with --sweep)")
    p.add_argument("--run-timeout", type=float, default=900, help="seconds at most for one system's run")
    g = p.add_argument_group("sweep (--sweep)")
    g.add_argument("--sweep", action="store_true", help="sizes x sequence lengths, then grow the model per system")
    g.add_argument("--sizes", type=_list(str, list(MODELS)), default=["1b", "3b"],
                   help="model shapes, smallest first (default 1b,3b); growth adds layers to the last")
    g.add_argument("--seqs", type=_list(int), default=[2048, 8192], help="sequence lengths (default 2048,8192)")
    g.add_argument("--sweep-tokens", type=int, default=32768, help="tokens per optimizer step (batch = this / seq)")
    g.add_argument("--sweep-micro-tokens", type=int, default=8192, help="tokens per micro-batch of the peers")
    g.add_argument("--grow-layers", type=int, default=14, help="layers added per growth level (0: no growth)")
    g.add_argument("--max-layers", type=int, default=224, help="growth stops here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--probe", help=argparse.SUPPRESS)
    return p


def main(doc: str, argv: list[str] | None = None) -> int:
    args = parser(doc).parse_args(argv)
    if args.child:
        from .child import main as child_main

        return child_main(args.child)
    if args.probe:
        from .probe import main as probe_main

        return probe_main(args.probe, args.device)

    from . import launcher
    from .spec import RunSpec, model_config
    from .sweep import Comparison, echo

    if not args.sweep:  # check the single run's numbers before starting anything
        try:
            RunSpec(system="pytorch", model=args.model, config=model_config(args.model, args.layers, args.seq),
                    seq=args.seq, batch=args.batch, micro_batch=args.micro_batch, steps=args.steps, warmup=args.warmup)
        except ValueError as e:
            print(f"peers.py: {e}", file=sys.stderr)
            return 2
    t0 = time.monotonic()
    echo("probing the machine (description and matmul peak)")
    machine = launcher.run_probe(args.device)
    peak = machine["matmul_peak"]
    echo(f"device {machine['device']}{' (' + machine['gpu'] + ')' if machine.get('gpu') else ''}: matmul peak "
         f"{peak['tflops']:.1f} TFLOP/s ({peak['dtype']})")
    budget = args.time_budget if args.time_budget is not None else (900.0 if args.sweep else None)
    if budget is not None:
        budget -= time.monotonic() - t0
    settings = {"steps": args.steps, "warmup": args.warmup, "seed": args.seed, "lr": args.lr, "betas": [0.9, 0.95],
                "eps": 1e-8, "weight_decay": 0.1, "max_grad_norm": 1.0, "command": " ".join(sys.argv),
                "sweep": args.sweep}
    cmp = Comparison(machine, args.out, args.logs, settings, budget, args.run_timeout, args.resume, args.retry_failed)
    echo(f"logs in {cmp.logs}")
    cmp.prepare(args.systems)
    if args.sweep:
        settings.update(sizes=args.sizes, seqs=args.seqs, sweep_tokens=args.sweep_tokens,
                        sweep_micro_tokens=args.sweep_micro_tokens, grow_layers=args.grow_layers)
        cmp.sweep(args.systems, args.sizes, args.seqs, args.sweep_tokens, args.sweep_micro_tokens, args.grow_layers,
                  args.max_layers)
    else:
        cmp.single(args.systems, args.model, args.layers, args.seq, args.batch, args.micro_batch)
    where = cmp.write()
    with open(where["md"]) as f:
        print(f.read())
    echo(f"wrote {where['json']}, {where['md']}; figure: {where['png']} ({time.monotonic() - t0:.0f} s in all)")
    return 0
