"""A ~100M-parameter mixture-of-experts model (Qwen3-MoE shape) on this CPU: megatrain against transformers'
own ``Qwen3MoeForCausalLM`` with ``torch.optim.AdamW``, step for step.

    python benchmarks/moe.py --rounds 6 --warmup 2      # fp32, CPU, 4 x 128 tokens per step

A model transformers saved (random weights, ``output_router_logits: true``: the load-balancing loss in both
losses) is trained by two worker processes, one per system, so each one's peak RSS is its own: megatrain
(``Engine.from_pretrained``, no plan: the README's own loop) and transformers (its model, fused
``torch.optim.AdamW``, ``clip_grad_norm_``). The driver asks them for one step at a time, in pairs whose order
alternates, so only one process computes at any moment and adjacent steps share the machine's drift. Reports
the median step seconds, the median of the per-pair ratios, each process's peak RSS (after loading and at the
end), the losses of every step (equal within float32 noise) and the load average before and after.
Writes ``benchmarks/results/<date>_cpu_moe_<model>.{json,md}``.
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
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from result_files import machine, write_report  # noqa: E402

# Qwen3-MoE's shape, scaled to ~100M parameters (~24M active per token): 6 layers of h512 (GQA 8/4 heads, q/k
# norms), 16 experts of width 576, 2 per token (renormalised), vocabulary 8192, untied.
MODELS = {"qwen3-moe-100m": dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=16,
                                 num_experts_per_tok=2, moe_intermediate_size=576, norm_topk_prob=True,
                                 max_position_embeddings=1024, tie_word_embeddings=False, output_router_logits=True,
                                 router_aux_loss_coef=0.001)}
SYSTEMS = ("megatrain", "transformers")
LR, BETAS, EPS, DECAY, CLIP = 1e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def worker(system: str, directory: str, batch: int, seq: int, rounds: int) -> None:
    """One system's process: load, then one step per line read from stdin; answers one JSON line each."""
    from throughput import batches

    config = json.load(open(os.path.join(directory, "config.json")))
    data = batches(config["vocab_size"], batch, seq, rounds)
    if system == "megatrain":
        from megatrain.runtime import Engine, OptimizerConfig

        engine = Engine.from_pretrained(directory, OptimizerConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY,
                                                                   max_grad_norm=CLIP),
                                        compute_dtype=torch.float32, device="cpu")

        def step(ids: torch.Tensor) -> dict:
            loss = engine.step(ids, ids).item()
            routing = engine.routing
            return {"loss": loss, "aux_loss": routing.aux_loss.item(), "expert_tokens": routing.tokens.sum(0).tolist()}
    else:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY, fused=True)

        def step(ids: torch.Tensor) -> dict:
            out = model(ids, labels=ids)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return {"loss": out.loss.item(), "aux_loss": out.aux_loss.item()}
    experts = None if system == "megatrain" else getattr(model.config, "_experts_implementation", None)
    print(json.dumps({"loaded_rss_bytes": rss_bytes(), "experts_implementation": experts}), flush=True)
    for line in sys.stdin:
        r = int(line)
        t0 = time.perf_counter()
        result = step(data[r])
        print(json.dumps({**result, "seconds": time.perf_counter() - t0, "rss_bytes": rss_bytes()}), flush=True)


def save_model(cfg: dict, directory: str) -> int:
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg))
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3-moe-100m")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="rounds left out of the medians")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--worker", nargs=2, metavar=("SYSTEM", "DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.batch, args.seq, args.rounds)
        return 0
    cfg = MODELS[args.model]
    with tempfile.TemporaryDirectory() as directory:
        params = save_model(cfg, directory)
        load_before = os.getloadavg()
        procs = {s: subprocess.Popen([sys.executable, __file__, "--worker", s, directory, "--batch", str(args.batch),
                                      "--seq", str(args.seq), "--rounds", str(args.rounds)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for s in SYSTEMS}
        ready = {s: json.loads(procs[s].stdout.readline()) for s in SYSTEMS}
        loaded = {s: ready[s]["loaded_rss_bytes"] for s in SYSTEMS}
        steps: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
        for r in range(args.rounds):
            for s in (SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]):  # alternate who goes first
                procs[s].stdin.write(f"{r}\n")
                procs[s].stdin.flush()
                steps[s].append(json.loads(procs[s].stdout.readline()))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{s} {steps[s][-1]['loss']:.6f} in {steps[s][-1]['seconds']:.2f} s" for s in SYSTEMS),
                file=sys.stderr, flush=True)
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    load_after = os.getloadavg()
    seconds = {s: [x["seconds"] for x in steps[s][args.warmup:]] for s in SYSTEMS}
    ratios = [a / b for a, b in zip(seconds["megatrain"], seconds["transformers"])]
    losses = {s: [x["loss"] for x in steps[s]] for s in SYSTEMS}
    rows = [{"system": s, "median_step_s": statistics.median(seconds[s]), "min_step_s": min(seconds[s]),
             "loaded_rss_bytes": loaded[s], "peak_rss_bytes": steps[s][-1]["rss_bytes"], "final_loss": losses[s][-1],
             "final_aux_loss": steps[s][-1]["aux_loss"]} for s in SYSTEMS]
    active = params - cfg["num_hidden_layers"] * (cfg["num_experts"] - cfg["num_experts_per_tok"]) * 3 * \
        cfg["hidden_size"] * cfg["moe_intermediate_size"]
    report = {"date": datetime.date.today().isoformat(), "machine": machine(), "args": vars(args), "params": params,
              "params_active": active, "model": cfg, "results": rows,
              "transformers_experts_implementation": ready["transformers"]["experts_implementation"],
              "median_ratio_megatrain_to_transformers": statistics.median(ratios), "ratios": ratios,
              "seconds": seconds, "losses": losses,
              "max_loss_difference": max(abs(a - b) for a, b in zip(losses["megatrain"], losses["transformers"])),
              "expert_tokens_last_step": steps["megatrain"][-1]["expert_tokens"],
              "load_average_1_5_15_min": {"before": load_before, "after": load_after},
              "command": f"python benchmarks/moe.py --model {args.model} --seq {args.seq} --batch {args.batch} "
                         f"--rounds {args.rounds} --warmup {args.warmup}"}
    write(report, args)
    return 0


def write(report: dict, args: argparse.Namespace) -> None:
    info, load = report["machine"], report["load_average_1_5_15_min"]
    lines = [f"# Mixture of experts on the CPU: megatrain vs transformers + torch.optim.AdamW, {args.model} "
             f"({report['params'] / 1e6:.1f}M total, {report['params_active'] / 1e6:.1f}M active), {args.batch} x "
             f"{args.seq} tokens/step, fp32 ({report['date']})", "",
             f"`{report['command']}`", "",
             f"{args.rounds - args.warmup} pairs of steps after {args.warmup} warm-up pairs, one process per system "
             f"(the order alternates pair by pair; one process computes at a time); load-balancing loss on (coef "
             f"{report['model']['router_aux_loss_coef']}). {info['cores']} cores ({info['cpu']}), torch "
             f"{info['torch']}; load average (1 min) {load['before'][0]:.1f} before and {load['after'][0]:.1f} after: "
             f"a shared machine, so the ratio of adjacent steps is the figure to read. Losses (cross-entropy + "
             f"coef x aux) of every step differ by at most {report['max_loss_difference']:.2e}.", "",
             "| system | median step s | min step s | RSS after load | peak RSS | last loss | last aux loss |",
             "|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['system']} | {r['median_step_s']:.3f} | {r['min_step_s']:.3f} | "
                     f"{r['loaded_rss_bytes'] / 2**30:.2f} GiB | {r['peak_rss_bytes'] / 2**30:.2f} GiB | "
                     f"{r['final_loss']:.6f} | {r['final_aux_loss']:.6f} |")
    lines += ["", f"Median of the per-pair step-time ratios, megatrain / transformers: "
              f"**{report['median_ratio_megatrain_to_transformers']:.2f}x**."]
    write_report(os.path.join(args.out, f"{report['date']}_cpu_moe_{args.model}"), report, lines)


if __name__ == "__main__":
    sys.exit(main())
