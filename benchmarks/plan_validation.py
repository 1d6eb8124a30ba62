"""The planner's predictions against the runtime's measurements: step time and peak host RSS.

    megatrain-plan calibrate                        # once: fit the constants on this machine
    python benchmarks/plan_validation.py            # fp32, ~10M .. ~300M parameters (a few minutes on a CPU)
    python benchmarks/plan_validation.py --quick    # the three smallest configs
    python benchmarks/plan_validation.py --spill-dir DIR   # and the spilled rows (everything on disk in DIR)
    python benchmarks/plan_validation.py --plan-only       # each config's plan and prediction; nothing runs

On a GPU (a CUDA device and a GPU's profile) the GPU configs run too, in the compute dtype each names (bf16:
Llama-3.2-1B's shape at 8192 tokens, -3B's, Llama-3.1-8B's, and a Qwen3-MoE shape). ``--plan-only`` plans
them wherever the profile is a GPU's (``MEGATRAIN_HARDWARE=<a GPU's hardware.json>``), CUDA or not.

The planner plans with the saved hardware profile (``megatrain-plan profile`` /
``calibrate``; its fitted constants where it has them, the defaults otherwise,
and the table says which). For each config the planner chooses a plan and
predicts step time and memory; a fresh subprocess (tools/calibrate.py's
measured run) runs a warm-up and ``--steps`` timed steps of the runtime with
that plan; the configs run in ``--rounds`` rounds (all once, then all again), so a
burst of other work slows one round of a config, not all its samples; the fastest
step of all rounds is kept (``--percentile`` to keep another) with the spread, and
the process's peak resident set. Errors are
(predicted - measured) / measured. On a CPU the "device" buffers live in host
memory, so peak RSS is compared with every buffer the planner counts plus its
process and temporaries terms; on a GPU, peak device memory with the device
buffers as well. The configs are not the calibration's models.
Writes ``benchmarks/results/<date>_<device>_plan_validation.{json,md,png}``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from result_files import figure, machine, write_report  # noqa: E402


def _llama(h: int, i: int, layers: int, heads: int, kv: int, vocab: int, **kw: object) -> dict[str, object]:
    return dict(model_type="llama", vocab_size=vocab, hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, **kw)


# name: (config.json fields, seq, batch); all fp32
CONFIGS = {
    "10M": (_llama(256, 768, 6, 4, 2, 12000), 256, 4),
    "50M": (_llama(512, 1536, 8, 8, 4, 16384, tie_word_embeddings=True), 256, 4),
    "110M": (dict(_llama(768, 2048, 10, 12, 4, 32000), model_type="qwen2"), 256, 2),
    "200M": (_llama(1024, 2816, 12, 16, 8, 32000), 256, 2),
    "300M": (_llama(1024, 2816, 20, 16, 8, 32000), 256, 2),
    # shapes unlike the calibration's models (4 layers, widths 256 .. 1024)
    "wide-shallow": (_llama(1536, 4096, 2, 12, 4, 32000), 256, 2),
    "deep-narrow": (_llama(256, 768, 32, 4, 2, 12000), 256, 4),
}
# With --spill-dir: the same models with master, gradients and AdamW state all in spill files there
# (spill="all"), the planner choosing the rest of the plan (the read-ahead's staging sets among it).
SPILL_CONFIGS = {
    "50M-spill": (_llama(512, 1536, 8, 8, 4, 16384, tie_word_embeddings=True), 256, 4),
    "200M-spill": (_llama(1024, 2816, 12, 16, 8, 32000), 256, 2),
}
# Mixtures of experts (fp32, the CPU's grouped experts), unlike the agreement tests' fixtures: top-2 of 8 experts
# (Mixtral) and top-4 of 16 (Qwen3-MoE, head_dim set apart from hidden / heads), each with the planner's plan, with
# every layer kept and with every layer recomputed (the plan's ``kept_layers`` replaced; ``KEEP``).
_MIXTRAL = dict(model_type="mixtral", vocab_size=8000, hidden_size=384, intermediate_size=512, num_hidden_layers=6,
                num_attention_heads=6, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
_QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=8000, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
                  moe_intermediate_size=256, norm_topk_prob=True)
MOE_CONFIGS = {
    "moe-8x2": (_MIXTRAL, 256, 4), "moe-8x2-kept": (_MIXTRAL, 256, 4), "moe-8x2-recomputed": (_MIXTRAL, 256, 4),
    "moe-16x4": (_QWEN3_MOE, 256, 4), "moe-16x4-kept": (_QWEN3_MOE, 256, 4),
    "moe-16x4-recomputed": (_QWEN3_MOE, 256, 4),
}
KEEP = {"-kept": "all", "-recomputed": "none"}  # a config name's ending: the layers its plan keeps
# On a GPU: name -> (config.json fields, seq, batch, compute dtype). Llama-3.2-1B's and -3B's shapes (tied),
# Llama-3.1-8B's (untied; with clipping its fp32 state needs 121.7 GiB of host RAM where the H200 machine has
# 118.1: "8B-24L" is its layer shape with 24 of its 32 layers, 6.2B), and Qwen3-30B-A3B's shape with 6 of its 48
# layers (128 experts, 8 a token; 4.4B); the calibration's models are 4-layer, widths 256 .. 1024, fp32 or bf16.
_L1B = _llama(2048, 8192, 16, 32, 8, 128256, tie_word_embeddings=True, rope_theta=500000.0)
_L3B = _llama(3072, 8192, 28, 24, 8, 128256, tie_word_embeddings=True, rope_theta=500000.0)
_L8B = _llama(4096, 14336, 32, 32, 8, 128256, rope_theta=500000.0)
_QWEN3_MOE_GPU = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                      num_hidden_layers=6, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                      rope_theta=1000000.0)
GPU_CONFIGS = {
    "1B-fp32": (_L1B, 2048, 8, "fp32"),
    "1B-8192": (_L1B, 8192, 4, "bf16"),
    "3B": (_L3B, 2048, 16, "bf16"),
    "8B": (_L8B, 4096, 16, "bf16"),
    "8B-24L": (dict(_L8B, num_hidden_layers=24), 4096, 16, "bf16"),
    "moe-gpu": (_QWEN3_MOE_GPU, 2048, 8, "bf16"),
}
STEP_GOAL, HOST_GOAL = 0.15, 0.10


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--quick", action="store_true", help="the three smallest configs")
    p.add_argument("--steps", type=int, default=3, help="timed steps per config after one warm-up (3)")
    p.add_argument("--rounds", type=int, default=2,
                   help="fresh processes per config, round by round over the configs; steps pooled (2)")
    p.add_argument("--percentile", type=float, default=0.0, help="which step to keep: 0 the fastest, 50 the median")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--spill-dir", help="also run SPILL_CONFIGS with everything spilled into this folder")
    p.add_argument("--only", help="comma-separated config names to run (default: all)")
    p.add_argument("--plan-only", action="store_true",
                   help="print each config's plan and the planner's prediction; run nothing, write nothing")
    args = p.parse_args(argv)

    from megatrain.planner.costs import cost_model, memory_model
    from megatrain.planner.shapes import model_shapes
    from megatrain.planner.profiling import profiler
    from megatrain.planner.choice import search
    from megatrain.planner.profiling.calibration import SPREAD_WARN, robust
    from megatrain.planner.shapes.workload import Workload
    from megatrain.tools.calibrate import run_in_rounds

    hw = profiler.this_machine()
    print(f"hardware: {hw.source}", file=sys.stderr, flush=True)
    configs = {name: (*entry, "fp32") for name, entry in dict(CONFIGS, **MOE_CONFIGS).items()}
    if not hw.device_is_host and (args.plan_only or cuda_present()):
        configs.update(GPU_CONFIGS)
    if args.quick:
        configs = dict(list(CONFIGS.items())[:3])
    if args.spill_dir:
        configs.update({name: (*entry, "fp32") for name, entry in SPILL_CONFIGS.items()})
    if args.only:
        unknown = set(args.only.split(",")) - set(configs)
        if unknown:
            print(f"plan_validation: --only {','.join(sorted(unknown))}: not a config here; of {', '.join(configs)}",
                  file=sys.stderr)
            return 2
        configs = {k: v for k, v in configs.items() if k in args.only.split(",")}
    constants = {dtype: hw.constants(dtype) for dtype in sorted({entry[3] for entry in configs.values()})}
    print(f"constants: {constants}", file=sys.stderr, flush=True)
    rows: list[dict[str, object]] = []
    planned = []  # (name, hf, seq, batch, shape, work, plan, cost, mem) of the configs that fit
    for name, (hf, seq, batch, dtype) in configs.items():
        shape = model_shapes.from_config(hf)
        spill = dict(spill="all", spill_dir=args.spill_dir) if name in SPILL_CONFIGS else {}
        work = Workload(seq_len=seq, batch=batch, compute_dtype=dtype, clipping=True, **spill)
        result = search.search(shape, work, hw)
        if result.best is None:
            rows.append({"config": name, "status": f"infeasible: {result.reason()}"})
            continue
        plan = keep(result.best.plan, name, shape.num_layers)
        print(f"{name}: {model_shapes.params_label(shape.params)} params, {batch} x {seq} tokens, {dtype}, plan "
              f"{plan.to_json(indent=None)}", file=sys.stderr, flush=True)
        planned.append((name, hf, seq, batch, shape, work, plan, cost_model.estimate(shape, work, plan, hw),
                        memory_model.estimate(shape, work, plan, hw)))
    if args.plan_only:
        print(plan_table(rows, planned, hw.device_is_host))
        return 0

    def progress(r: int, i: int) -> None:
        print(f"round {r + 1}/{args.rounds}: {planned[i][0]}", file=sys.stderr, flush=True)

    try:
        # the measured run's dtype as tools/calibrate.py names it (fp32 or bf16)
        runs = run_in_rounds([(hf, seq, batch, "fp32" if work.compute_bytes == 4 else "bf16", plan.to_json(indent=None),
                               args.steps, 0) for _, hf, seq, batch, _, work, plan, _, _ in planned], args.rounds,
                             progress)
    except ValueError as e:
        print(f"plan_validation: error: {e}", file=sys.stderr)
        return 2
    for (name, hf, seq, batch, shape, work, plan, cost, mem), measured in zip(planned, runs):
        step = robust([s["step_s"] for s in measured["steps"]], args.percentile)
        if hw.device_is_host:
            predicted_host = mem.device_bytes + mem.host_bytes
        else:
            predicted_host = mem.host_bytes
        predicted_device = None if hw.device_is_host else mem.device_bytes
        rows.append({
            "config": name, "status": "ok", "params": shape.params, "tokens": work.tokens,
            "compute_dtype": work.compute_dtype, "plan": plan.to_dict(),
            "predicted_step_seconds": cost.step_seconds, "measured_step_seconds": step.value,
            "step_spread": step.spread, "step_error": cost.step_seconds / step.value - 1,
            "predicted_host_bytes": predicted_host, "measured_peak_rss_bytes": measured["peak_rss_bytes"],
            "host_error": predicted_host / measured["peak_rss_bytes"] - 1,
            "measured_baseline_rss_bytes": measured["baseline_rss_bytes"],
            "predicted_device_bytes": predicted_device, "measured_device_bytes": measured["peak_device_bytes"],
            "device_error": (predicted_device / measured["peak_device_bytes"] - 1) if predicted_device else None,
            "bottleneck": cost.bottleneck, "step_times": [s["step_s"] for s in measured["steps"]],
            "memory": mem.rows()})
        r = rows[-1]
        if plan.spill != "none":  # the disk's share: predicted seconds of its bytes, measured busy and exposed
            r["disk"] = {"predicted_disk_seconds": cost.disk_seconds,
                         **{k: [s.get(k) for s in measured["steps"]] for k in ("disk_busy_s", "disk_exposed_s",
                                                                              "compute_s", "adam_busy_s")}}
        print(f"  step {r['predicted_step_seconds']:.3f} s predicted, {r['measured_step_seconds']:.3f} s measured "
              f"({r['step_error']:+.1%}, spread {step.spread:.0%}); peak RSS {predicted_host / 2**30:.3f} GiB "
              f"predicted, {measured['peak_rss_bytes'] / 2**30:.3f} measured ({r['host_error']:+.1%})",
              file=sys.stderr, flush=True)

    device = "cpu" if hw.device_is_host else hw.gpu_name.replace(" ", "-")
    today = datetime.date.today().isoformat()
    command = "python benchmarks/plan_validation.py" + "".join(f" {a}" for a in sys.argv[1:])
    report = {"date": today, "device": device, "command": command, "machine": machine(), "constants": constants,
              "hardware": hw.to_dict(), "goal": {"step_error": STEP_GOAL, "host_error": HOST_GOAL},
              "kept": "fastest step" if args.percentile == 0 else f"p{args.percentile:g} step", "results": rows}
    pct = lambda x: "-" if x is None else f"{x:+.1%}"  # noqa: E731
    ok = [r for r in rows if r["status"] == "ok"]
    lines = [f"# Planner vs runtime, {device} ({today})", "",
             f"`{command}`; constants: {constants}.", "",
             "| config | dtype | params | step predicted s | step measured s | error | spread | peak RSS predicted GiB "
             "| peak RSS measured GiB | error | device error | bound by |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['config']} | {r['status']} | | | | | | | | | | |")
            continue
        lines.append(f"| {r['config']} | {r['compute_dtype']} | {model_shapes.params_label(r['params'])} | "
                     f"{r['predicted_step_seconds']:.3f} | {r['measured_step_seconds']:.3f} | {pct(r['step_error'])} | "
                     f"{r['step_spread']:.0%} | {r['predicted_host_bytes'] / 2**30:.3f} | "
                     f"{r['measured_peak_rss_bytes'] / 2**30:.3f} | {pct(r['host_error'])} | "
                     f"{pct(r['device_error'])} | {r['bottleneck']} |")
    within = sum(abs(r["step_error"]) <= STEP_GOAL and abs(r["host_error"]) <= HOST_GOAL for r in ok)
    noisy = [r["config"] for r in ok if r["step_spread"] > SPREAD_WARN]
    lines += ["", f"Goal: step time within {STEP_GOAL:.0%}, peak host RSS within {HOST_GOAL:.0%}: {within} of "
              f"{len(ok)} configs. Measured step: the {report['kept']} of {args.rounds} x {args.steps} (rounds x steps "
              "after a warm-up, a fresh process per config and round, the rounds one after another over all "
              "configs); spread = (slowest - fastest) / fastest. Peak RSS: the process's peak resident "
              "set, against every buffer the planner counts (device ones included where the device is the CPU) "
              "plus its process and temporaries terms."]
    if noisy:
        lines.append(f"Step times spread over {SPREAD_WARN:.0%} in {', '.join(noisy)}: the machine was busy; "
                     "re-run on a quiet machine.")
    stem = write_report(os.path.join(args.out, f"{today}_{device}_plan_validation"), report, lines)
    print(f"plot: {plot(ok, stem + '.png')}", file=sys.stderr)
    return 0


def cuda_present() -> bool:
    """A CUDA device here: the GPU configs run only on one."""
    import torch

    return torch.cuda.is_available()


def plan_table(rows: list[dict[str, object]], planned: list, device_is_host: bool) -> str:
    """``--plan-only``'s table: each config's plan and predictions, and the configs no plan fits."""
    gib = 2 ** 30
    lines = ["| config | params | dtype | tokens | plan | predicted step s | host GiB | device GiB | bound by |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, _, seq, batch, shape, work, plan, cost, mem in planned:
        host = (mem.device_bytes + mem.host_bytes) if device_is_host else mem.host_bytes
        lines.append(f"| {name} | {shape.params / 1e9:.2f}B | {work.compute_dtype} | {batch} x {seq} | mb "
                     f"{plan.micro_batch_size}, {plan.num_slots} slots, {plan.optimizer_mode}, kept "
                     f"{len(plan.kept_layers)} of {shape.num_layers}, resident {len(plan.resident_blocks)} | "
                     f"{cost.step_seconds:.3f} | {host / gib:.2f} | "
                     f"{'-' if device_is_host else format(mem.device_bytes / gib, '.2f')} | {cost.bottleneck} |")
    lines += [f"| {r['config']} | {r['status']} | | | | | | | |" for r in rows if r["status"] != "ok"]
    return "\n".join(lines)


def keep(plan, name: str, layers: int):
    """``plan`` keeping every layer or none where ``name`` ends so (``KEEP``), else as it is."""
    mode = next((m for end, m in KEEP.items() if name.endswith(end)), None)
    if mode is None:
        return plan
    return plan.replace(kept_layers=tuple(range(layers)) if mode == "all" else ())


def plot(rows: list[dict[str, object]], path: str) -> str:
    """Predicted over measured step time and peak RSS against parameters."""
    if not rows:
        return "none (no successful configs)"
    params = [r["params"] / 1e6 for r in rows]

    def draw(ax) -> None:
        ax.plot(params, [1 + r["step_error"] for r in rows], "o-", label="step time")
        ax.plot(params, [1 + r["host_error"] for r in rows], "s-", label="peak host RSS")
        for lo, hi, color in ((1 - STEP_GOAL, 1 + STEP_GOAL, "tab:blue"), (1 - HOST_GOAL, 1 + HOST_GOAL, "tab:orange")):
            ax.axhspan(lo, hi, color=color, alpha=0.08)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("parameters (M)")
        ax.set_ylabel("predicted / measured")
        ax.legend()
        ax.grid(alpha=0.3)

    return figure(path, (7, 4), draw, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
