"""The planner's predictions against the runtime's measurements: step time and peak memory.

    python benchmarks/plan_validation.py            # CPU here, or the GPU where there is one
    python benchmarks/plan_validation.py --quick    # two small configs

This machine is profiled once (``megatrain-plan profile``'s measurement); then for
each config the planner chooses a plan, predicts step time and memory, and a fresh
subprocess runs real steps of the runtime with that plan, measuring the median
step time, peak device memory (CUDA) and the growth of peak host RSS over the
process before the engine existed. Errors are (predicted - measured) / measured.
On a CPU the "device" buffers live in host memory, so they are compared with the
RSS growth together with the host buffers; the planner's fixed allowance for the
process itself is left out of the prediction, since the baseline RSS is.
Writes ``benchmarks/results/<date>_<device>_plan_validation.{json,md}``.
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

HERE = os.path.dirname(os.path.abspath(__file__))

CONFIGS = {
    "12M-fp32": (dict(model_type="llama", vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4), 256, 8, "fp32"),
    "52M-fp32": (dict(model_type="llama", vocab_size=16384, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True), 256, 4, "fp32"),
    "110M-bf16": (dict(model_type="qwen2", vocab_size=32000, hidden_size=768, intermediate_size=2048,
                       num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4), 512, 4, "bf16"),
}
GPU_CONFIGS = {
    "1B-bf16": (dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                     rope_theta=500000.0), 2048, 32, "bf16"),
}


def child(name: str, plan_json: str, steps: int) -> None:
    """Run the runtime with the given plan; print one JSON line of measurements."""
    import torch

    from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan

    hf, seq, batch, dtype = {**CONFIGS, **GPU_CONFIGS}[name]
    baseline_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    engine = Engine(ModelConfig.from_hf(hf), OptimizerConfig(lr=1e-4, max_grad_norm=1.0), plan=Plan.from_json(plan_json),
                    compute_dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    times = []
    for i in range(steps):
        ids = torch.randint(0, hf["vocab_size"], (batch, seq), generator=gen)
        t0 = time.perf_counter()
        engine.step(ids, ids).item()
        times.append(time.perf_counter() - t0)
        print(f"    step {i + 1}/{steps}: {times[-1]:.3f} s", file=sys.stderr, flush=True)
    engine.synchronize()
    cuda = engine.device.type == "cuda"
    out = {"step_seconds": statistics.median(times[1:] or times), "times": times,
           "peak_rss_growth_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline_rss,
           "peak_device_bytes": torch.cuda.max_memory_allocated() if cuda else None}
    engine.close()
    print(json.dumps(out))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the two smallest configs, 3 steps each")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return 0

    from megatrain.planner import cost_model, memory_model, model_shapes, search
    from megatrain.planner.profiler import measure
    from megatrain.planner.workload import Workload

    print("profiling this machine ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as spill:
        hw = measure(spill_dir=spill, log=lambda s: print(f"  {s}", file=sys.stderr, flush=True))
    configs = dict(CONFIGS)
    if not hw.device_is_host:
        configs.update(GPU_CONFIGS)
    if args.quick:
        configs = dict(list(CONFIGS.items())[:2])
        args.steps = 3
    rows = []
    for name, (hf, seq, batch, dtype) in configs.items():
        shape = model_shapes.from_config(hf)
        work = Workload(seq_len=seq, batch=batch, compute_dtype=dtype, clipping=True)
        result = search.search(shape, work, hw)
        if result.best is None:
            rows.append({"config": name, "status": "infeasible"})
            continue
        plan = result.best.plan
        cost = cost_model.estimate(shape, work, plan, hw)
        mem = memory_model.estimate(shape, work, plan, hw)
        process = sum(c.nbytes for c in mem.components if c.name == "process")
        print(f"{name}: {batch} x {seq} tokens, plan {plan.to_json(indent=None)}", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, __file__, "--child", name, plan.to_json(indent=None), str(args.steps)],
                              stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            rows.append({"config": name, "status": f"failed with exit status {proc.returncode}"})
            continue
        measured = json.loads(proc.stdout.strip().splitlines()[-1])
        if hw.device_is_host:
            predicted_host = mem.device_bytes + mem.host_bytes - process
            predicted_device = None
        else:
            predicted_host = mem.host_bytes - process
            predicted_device = mem.device_bytes
        row = {"config": name, "status": "ok", "params": shape.params, "tokens": work.tokens, "plan": plan.to_dict(),
               "predicted_step_seconds": cost.step_seconds, "measured_step_seconds": measured["step_seconds"],
               "step_error": cost.step_seconds / measured["step_seconds"] - 1,
               "predicted_host_bytes": predicted_host, "measured_host_bytes": measured["peak_rss_growth_bytes"],
               "host_error": predicted_host / measured["peak_rss_growth_bytes"] - 1,
               "predicted_device_bytes": predicted_device, "measured_device_bytes": measured["peak_device_bytes"],
               "device_error": (predicted_device / measured["peak_device_bytes"] - 1) if predicted_device else None,
               "bottleneck": cost.bottleneck, "step_times": measured["times"]}
        rows.append(row)

    device = "cpu" if hw.device_is_host else hw.gpu_name.replace(" ", "-")
    report = {"date": datetime.date.today().isoformat(), "device": device, "hardware": json.loads(hw.to_json()),
              "results": rows}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{report['date']}_{device}_plan_validation")
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=2)
    pct = lambda x: "-" if x is None else f"{x:+.1%}"  # noqa: E731
    lines = [f"# Planner vs runtime, {device} ({report['date']})", "",
             "| config | step predicted s | step measured s | error | host predicted GiB | host measured GiB | error "
             "| device error | bound by |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['config']} | {r['status']} | | | | | | | |")
            continue
        lines.append(f"| {r['config']} | {r['predicted_step_seconds']:.3f} | {r['measured_step_seconds']:.3f} | "
                     f"{pct(r['step_error'])} | {r['predicted_host_bytes'] / 2**30:.3f} | "
                     f"{r['measured_host_bytes'] / 2**30:.3f} | {pct(r['host_error'])} | {pct(r['device_error'])} | "
                     f"{r['bottleneck']} |")
    lines += ["", "Host on a CPU: peak RSS growth over the process before the engine, against every buffer the planner "
              "counts (device ones included: the device is the CPU) less its fixed process allowance."]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
