"""Long context: peak memory, step time and throughput against sequence length, with the planner's prediction.

    python benchmarks/long_context.py                      # CPU: a tiny shape at 16k, 32k, 64k tokens
    python benchmarks/long_context.py --seqs 32768 65536 131072 --layers 2

For a model shape and a list of sequence lengths (batch 1, fp32 on a CPU), each
length runs in a fresh process (tools/calibrate.py's measured run: one warm-up
step, then ``--steps`` timed ones) with the plan the planner's rules give
(``mlp_tile_tokens`` and ``attention_tile_tokens`` from ``search.sequence_tile_tokens``, checkpoints where
``--checkpoints`` says). Reported: peak RSS growth over the process's baseline
(on a CPU the device buffers are host memory), the planner's listed buffers for
the same plan (``memory_model.listed_host_bytes``: every buffer, without the
fixed process terms) and the error, step time, tokens/s, and model TFLOP/s
without attention (6 x N_matmul per token, benchmarks/README.md; the every-parameter figure beside
it) and with attention FLOPs by the model convention (causal: forward + backward 2x forward,
``ModelShape.attention_model_flops_per_token``). On a GPU, peak device memory would be compared with
the device buffers; not measured here yet.
Writes ``benchmarks/results/<date>_<device>_long_context.{json,md,png}``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from result_files import figure, machine, write_report

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--seqs", type=int, nargs="+", default=[16384, 32768, 65536])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--checkpoints", choices=("device", "host"), default="device")
    p.add_argument("--piece-tokens", type=int, default=None,
                   help="host checkpoints: tokens per copy (default: the planner's search.checkpoint_piece_tokens)")
    p.add_argument("--untiled", action="store_true", help="no sequence tiles (to compare)")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--from-json", help="write the table and plot again from a results JSON, running nothing")
    args = p.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        stem = os.path.splitext(args.from_json)[0]
        text = "\n".join(markdown(saved, saved["command"])) + "\n"
        with open(stem + ".md", "w") as f:
            f.write(text)
        print(text, end="")
        print(f"wrote {stem}.md; plot: {plot(saved['results'], stem + '.png')}", file=sys.stderr)
        return 0
    from megatrain.planner.costs import cost_model, memory_model
    from megatrain.planner.shapes import model_shapes
    from megatrain.planner.profiling import profiler
    from megatrain.planner.choice import search
    from megatrain.plan.plan import Plan
    from megatrain.planner.shapes.workload import Workload
    from megatrain.tools.calibrate import run_model

    hf = dict(model_type="llama", vocab_size=args.vocab, hidden_size=args.hidden,
              intermediate_size=args.intermediate, num_hidden_layers=args.layers, num_attention_heads=args.heads,
              num_key_value_heads=args.kv_heads, head_dim=args.head_dim, max_position_embeddings=max(args.seqs))
    shape = model_shapes.from_config(hf)
    hw = profiler.this_machine()
    rows = []
    for seq in args.seqs:
        work = Workload(seq_len=seq, batch=1, compute_dtype="fp32", clipping=True)
        pieces = (args.piece_tokens or search.checkpoint_piece_tokens(shape, work, 1)
                  if args.checkpoints == "host" else None)
        plan = Plan(checkpoints=args.checkpoints, loss_chunk_tokens=4096, checkpoint_piece_tokens=pieces,
                    mlp_tile_tokens=None if args.untiled else search.sequence_tile_tokens(seq),
                    attention_tile_tokens=None if args.untiled else search.sequence_tile_tokens(seq))
        mem = memory_model.estimate(shape, work, plan, hw)
        listed = memory_model.listed_host_bytes(mem, True)
        layer = next(c for c in mem.components if c.name == "layer working set")
        attention = next(c for c in mem.components if c.name == "attention working set")
        print(f"seq {seq}: plan {plan.to_json(indent=None)}; listed {listed / 2**30:.3f} GiB ...",
              file=sys.stderr, flush=True)
        measured = run_model(hf, seq, 1, "fp32", plan.to_json(indent=None), args.steps)
        step = min(s["step_s"] for s in measured["steps"])
        growth = measured["peak_rss_growth_bytes"]
        attn = seq * shape.attention_model_flops_per_token(seq)
        model_flops = shape.model_flops_per_token() * seq
        predicted = cost_model.estimate(shape, work, plan, hw) if hw is not None else None
        rows.append({"seq": seq, "plan": plan.to_dict(), "peak_rss_growth_bytes": growth,
                     "baseline_rss_bytes": measured["baseline_rss_bytes"], "listed_bytes": listed,
                     "layer_working_set_bytes": layer.nbytes, "layer_working_set_formula": layer.formula,
                     "attention_working_set_bytes": attention.nbytes,
                     "attention_working_set_formula": attention.formula,
                     "memory_error": listed / growth - 1, "step_seconds": step, "tokens_per_second": seq / step,
                     "model_tflops": model_flops / step / 1e12, "model_tflops_with_attention":
                     (model_flops + attn) / step / 1e12,
                     "all_params_tflops": shape.all_params_flops_per_token() * seq / step / 1e12,
                     "predicted_step_seconds": predicted.step_seconds if predicted else None,
                     "memory": mem.rows()})
        r = rows[-1]
        print(f"  peak RSS growth {growth / 2**30:.3f} GiB, planner {listed / 2**30:.3f} GiB "
              f"({r['memory_error']:+.1%}); step {step:.1f} s, {r['tokens_per_second']:.0f} tok/s",
              file=sys.stderr, flush=True)
    today = datetime.date.today().isoformat()
    command = "python benchmarks/long_context.py" + "".join(f" {a}" for a in sys.argv[1:])
    report = {"date": today, "device": "cpu", "command": command, "machine": machine(), "model": hf,
              "params": shape.params, "matmul_params_active": shape.matmul_params_active, "checkpoints": args.checkpoints, "results": rows}
    base = os.path.join(args.out, f"{today}_cpu_long_context{'_host' if args.checkpoints == 'host' else ''}"
                                  f"{'_untiled' if args.untiled else ''}")
    stem = write_report(base, report, markdown(report, command))
    print(f"plot: {plot(rows, stem + '.png')}", file=sys.stderr)
    return 0


def markdown(report: dict, command: str) -> list[str]:
    """The Markdown table of a results JSON."""
    rows, today = report["results"], report["date"]
    lines = [f"# Long context on a CPU ({today})", "", f"`{command}`; {report['params']:,} "
             f"params, fp32, batch 1, checkpoints on the {report.get('checkpoints', 'device')}.", "",
             "| seq | MLP tile | attention tile | checkpoint piece | peak RSS growth GiB | planner's buffers GiB "
             "| error | layer working set GiB | attention working set GiB | step s | step predicted s | tok/s "
             "| model TFLOP/s (6 N_matmul, attention not counted) | with attention |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        predicted = r.get("predicted_step_seconds")
        lines.append(f"| {r['seq']} | {r['plan']['mlp_tile_tokens'] or '-'} | "
                     f"{r['plan'].get('attention_tile_tokens') or '-'} | "
                     f"{r['plan'].get('checkpoint_piece_tokens') or '-'} | {r['peak_rss_growth_bytes'] / 2**30:.3f} | "
                     f"{r['listed_bytes'] / 2**30:.3f} | {r['memory_error']:+.1%} | "
                     f"{r['layer_working_set_bytes'] / 2**30:.3f} | "
                     f"{r.get('attention_working_set_bytes', 0) / 2**30:.3f} | {r['step_seconds']:.1f} | "
                     f"{'-' if predicted is None else f'{predicted:.1f}'} | "
                     f"{r['tokens_per_second']:.0f} | {r['model_tflops']:.4f} | {r['model_tflops_with_attention']:.4f} |")
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        measured = (b["peak_rss_growth_bytes"] - a["peak_rss_growth_bytes"]) / (b["seq"] - a["seq"])
        planned = (b["listed_bytes"] - a["listed_bytes"]) / (b["seq"] - a["seq"])
        offset = [r["peak_rss_growth_bytes"] - r["listed_bytes"] for r in rows]
        lines += ["", f"Memory per added token from {a['seq']} to {b['seq']} tokens: measured {measured:.0f} B, "
                  f"planner {planned:.0f} B ({planned / measured - 1:+.1%}); linear, not quadratic, in length. "
                  f"Measured minus planned at each length: {', '.join(f'{o / 2**20:.0f}' for o in offset)} MiB "
                  "(a constant: the process's own transients, which the planner's fitted temporaries term covers "
                  "after megatrain-plan calibrate)."]
    lines += ["", "Peak RSS growth: the process's peak resident set over its baseline before the engine; "
              "planner's buffers: every buffer memory_model lists for the plan (device ones are host memory on a "
              "CPU), without its fixed process terms."]
    return lines


def plot(rows: list[dict[str, object]], path: str) -> str:
    def draw(ax) -> None:
        seqs = [r["seq"] for r in rows]
        ax.plot(seqs, [r["peak_rss_growth_bytes"] / 2**30 for r in rows], "o-", label="peak RSS growth (measured)")
        ax.plot(seqs, [r["listed_bytes"] / 2**30 for r in rows], "s--", label="planner's buffers")
        ax.set_xlabel("tokens per sequence")
        ax.set_ylabel("GiB")
        ax.legend()

    return figure(path, (6, 4), draw)


if __name__ == "__main__":
    sys.exit(main())
