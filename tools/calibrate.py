"""megatrain-plan calibrate: fit the planner's cost and memory constants from real training steps.

    megatrain-plan calibrate                 # fp32, a few small models, a couple of minutes on a CPU
    python -m megatrain.tools.calibrate      # the same

Each model runs in a fresh process (so its peak RSS is its own): a warm-up step, then ``--steps`` timed
steps through the runtime with the plan the planner chooses; the step breakdown gives compute, copy and AdamW.
The models run in ``--rounds`` rounds (all once, then all again), so a burst of
other work slows one round of a model rather than all its samples; each figure
keeps the best sample of all rounds (or ``--percentile``) and records the spread;
the planner's fitting arithmetic (planner/profiling/calibration.py) turns them into the
terms the hardware profile stores with their source. The planner reads them
from the profile; it never imports this module or the runtime.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

from megatrain.errors import MegatrainError
from megatrain.tools.calibration_runs import OVERHEAD_RUN, RUNS, SPARSE_RUN

PROG = "megatrain-plan calibrate"
FITTED_NOTE = "cost and memory constants fitted by megatrain-plan calibrate"
DTYPES = ("fp32", "bf16")

class CalibrateError(MegatrainError):
    """Bad input or a failed run: one line, with the fix."""


# ---- the measured run (in its own process) ------------------------------------------------------
def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec["steps"]`` steps (after one warm-up) of the model with the plan, in a process that keeps its
    freed heap as ``megatrain-train``'s does ([Note: freed heap]); per-step measurements."""
    import torch

    from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan, keep_freed_heap
    keep_freed_heap()
    hf, seq, batch = spec["config"], spec["seq"], spec["batch"]
    dtype = torch.float32 if spec["dtype"] == "fp32" else torch.bfloat16
    baseline = current_rss()  # imports done, no engine yet (their own transient peak is not a baseline)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, hf["vocab_size"], (batch, seq), generator=gen) for _ in range(2)]
    steps: list[dict[str, float]] = []
    with Engine(ModelConfig.from_hf(hf), OptimizerConfig(lr=1e-4, max_grad_norm=1.0),
                plan=Plan.from_json(spec["plan"]), compute_dtype=dtype) as engine:
        for i in range(spec["steps"] + 1):
            ids = batches[i % 2]
            engine.time_next_step()  # every step: the fit reads each one's breakdown
            t0 = time.perf_counter()
            engine.step(ids, ids).item()
            wall = time.perf_counter() - t0
            bd = dict(engine.last_step_breakdown or {})
            bd["wall_s"] = wall
            if i > 0:  # the first step warms caches and the allocator
                steps.append(bd)
        engine.synchronize()
        # the AdamW worker's busy time of the last step is known once its updates are done
        last = engine.last_step_breakdown or {}
        if "adam_busy_s" in last and steps:
            steps[-1]["adam_busy_s"] = last["adam_busy_s"]
        cuda = engine.device.type == "cuda"
        peak_device = int(torch.cuda.max_memory_allocated()) if cuda else None
        device = engine.device
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak resident set
    out = {"steps": steps, "baseline_rss_bytes": int(baseline), "peak_rss_bytes": int(peak),
           "peak_rss_growth_bytes": int(max(0, peak - baseline)), "peak_device_bytes": peak_device, "cuda": cuda}
    if spec.get("head_samples", 0) > 0:
        plan = Plan.from_json(spec["plan"])
        out["head_s"] = head_seconds(hf["hidden_size"], hf["vocab_size"], min(plan.micro_batch_size, batch), seq,
                                     -(-batch // plan.micro_batch_size), plan.loss_chunk_tokens, dtype, device,
                                     spec["head_samples"])
    return out


def head_seconds(h: int, vocab: int, mbs: int, seq: int, micro_batches: int, chunk: int, dtype: Any, device: Any,
                 samples: int) -> list[float]:
    """Seconds of the step's head (final norm, chunked lm_head + cross-entropy, and their backward) for every
    micro-batch, timed alone with the runtime's own head function on the run's shapes: the head is one shape
    class (a [t, h] x [h, vocab] matmul), the decoder layers another."""
    import torch

    from megatrain.runtime.model.head_loss import head_forward_backward

    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, h, generator=gen) * 0.02).to(device=device, dtype=dtype)
    grad = torch.zeros(vocab, h, device=device)
    norm_params = {"norm.weight": torch.ones(h, device=device, dtype=dtype)}
    x = torch.randn(mbs, seq, h, generator=gen).to(device=device, dtype=dtype)
    labels = torch.randint(0, vocab, (mbs, seq), generator=gen).to(device)
    n_tokens = torch.tensor(float(micro_batches * mbs * seq), device=device)

    def norm(p: dict[str, Any], t: Any) -> Any:
        return torch.nn.functional.rms_norm(t.float(), (h,), None, 1e-5).to(dtype) * p["norm.weight"]

    def once() -> float:
        t0 = time.perf_counter()
        for _ in range(micro_batches):
            head_forward_backward(norm, norm_params, weight, x, labels, n_tokens, chunk, grad)
        if device.type == "cuda":
            torch.cuda.synchronize()  # the timing needs the kernels done
        return time.perf_counter() - t0

    once()
    return [once() for _ in range(samples)]


def current_rss() -> int:
    """Resident bytes of this process now (/proc/self/statm; the peak so far where that is absent)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_model(config: dict[str, Any], seq: int, batch: int, dtype: str, plan_json: str, steps: int,
              head_samples: int = 0) -> dict[str, Any]:
    """``child`` in a fresh Python process (its peak RSS is this run's alone)."""
    spec = json.dumps({"config": config, "seq": seq, "batch": batch, "dtype": dtype, "plan": plan_json,
                       "steps": steps, "head_samples": head_samples})
    proc = subprocess.run([sys.executable, "-m", "megatrain.tools.calibrate", "--child", spec],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise CalibrateError(f"a calibration run failed ({tail}); check that megatrain-train runs on this machine")
    return json.loads(proc.stdout.strip().splitlines()[-1])


Measurement = tuple[dict[str, Any], int, int, str, str, int, int]  # (config, seq, batch, dtype, plan JSON, steps, head)


def run_in_rounds(measurements: Sequence[Measurement], rounds: int,
                  log: Callable[[int, int], None] = lambda r, i: None) -> list[dict[str, Any]]:
    """Every measurement ``rounds`` times, round by round (all of them once, then all again), each time in a
    fresh process (``run_model``). A burst of other work on the machine then slows one round of a model, not
    every sample of it: the steps and head timings of all rounds are pooled for ``robust`` to choose from;
    memory figures are the first round's (the same buffers every round). ``log(round, index)`` before each."""
    if rounds < 1:
        raise CalibrateError(f"--rounds={rounds} must be 1 or more")
    pooled: list[dict[str, Any]] = []
    for r in range(rounds):
        for i, (config, seq, batch, dtype, plan_json, steps, head) in enumerate(measurements):
            log(r, i)
            got = run_model(config, seq, batch, dtype, plan_json, steps, head_samples=head)
            if r == 0:
                pooled.append(got)
            else:
                pooled[i]["steps"] += got["steps"]
                if got.get("head_s"):
                    pooled[i]["head_s"] = pooled[i].get("head_s", []) + got["head_s"]
    return pooled


def reduce_run(name: str, config: dict[str, Any], seq: int, batch: int, dtype: str, plan: Any,
               measured: dict[str, Any], hw: Any, percentile: float) -> Any:
    """Measured steps -> a RunSample: each figure at ``percentile`` of its samples, with the planner's
    FLOPs, overhead units, traffic and listed buffers for the same model and plan."""
    from megatrain.planner.costs import cost_model, memory_model, step_traffic
    from megatrain.planner.shapes import model_shapes
    from megatrain.planner.profiling.calibration import RunSample, robust
    from megatrain.planner.shapes.workload import Workload

    shape = model_shapes.from_config(config)
    work = Workload(seq_len=seq, batch=batch, compute_dtype=dtype, clipping=True)
    steps = measured["steps"]
    if not steps:
        raise CalibrateError(f"run {name} measured no steps; pass --steps 1 or more")

    def pick(key: str, default: float = 0.0) -> Any:
        return robust([s.get(key, default) for s in steps], percentile)

    h2d, d2h = pick("h2d_busy_s"), pick("d2h_busy_s")
    adam_samples = [s["adam_busy_s"] for s in steps if "adam_busy_s" in s]
    adam = robust(adam_samples, percentile) if adam_samples else None
    step = pick("step_s")
    if measured["cuda"]:
        compute = pick("compute_s")
    else:
        # No GPU: copies and AdamW share the cores with compute; the cost model adds them in series, so
        # compute = step - H2D busy - D2H busy - AdamW busy, per sample.
        compute = robust([s["step_s"] - s.get("h2d_busy_s", 0.0) - s.get("d2h_busy_s", 0.0)
                          - s.get("adam_busy_s", adam.value if adam else 0.0) for s in steps], percentile)
    head = robust(measured["head_s"], percentile) if measured.get("head_s") else None
    h2d_bytes, d2h_bytes = step_traffic.traffic(shape, work, plan)
    # the layers' causal attention (forward, recompute, backward), timed at the profile's measured rate
    attention_flops = step_traffic.hardware_attention_flops(shape, work)
    attention_rate = hw.attention_rate_tflops(dtype, seq)
    est = memory_model.estimate(shape, work, plan, hw)
    return RunSample(
        name=name, hidden_size=shape.hidden_size, params=shape.params,
        flops=shape.hardware_flops_per_token(seq) * work.tokens,
        overhead_units=cost_model.overhead_units(shape, work, plan), compute_s=compute.value,
        h2d_bytes=h2d_bytes, h2d_s=h2d.value, d2h_bytes=d2h_bytes, d2h_s=d2h.value,
        adam_params=shape.numel_total if adam else 0, adam_s=adam.value if adam else 0.0, step_s=step.value,
        baseline_rss_bytes=measured["baseline_rss_bytes"], peak_rss_growth_bytes=measured["peak_rss_growth_bytes"],
        listed_bytes=memory_model.listed_host_bytes(est, hw.device_is_host),
        transient_bytes=memory_model.transient_bytes(shape, work, plan),
        spread=max(step.spread, compute.spread), tokens_per_micro_batch=min(plan.micro_batch_size, batch) * seq,
        head_flops=(shape.head_flops_fwd() + shape.head_flops_bwd()) * work.tokens if head else 0.0,
        head_s=head.value if head else 0.0, head_units=cost_model.head_overhead_units(shape, work, plan),
        attention_flops=attention_flops if attention_rate else 0.0,
        attention_s=attention_flops / (attention_rate * 1e12) if attention_rate else 0.0,
        expert_flops=shape.num_layers * 4.0 * shape.expert_flops_fwd() * work.tokens)  # fwd + recompute + 2 x


def base_profile(out: str | None, log: Callable[[str], None]) -> tuple[Any, str]:
    """The profile to calibrate and where it goes: ``out``, else the saved profile the planner reads; measured
    first (megatrain-plan profile's figures) when that file does not exist yet. An existing file that is not
    a hardware profile is refused, never overwritten."""
    from megatrain.planner.profiling import profiler
    from megatrain.planner.profiling.hardware import HardwareError, HardwareProfile

    path = out or os.environ.get("MEGATRAIN_HARDWARE") or profiler.CACHE_PATH
    if os.path.isdir(path):
        raise CalibrateError(f"--out={path!r} is a directory; pass a file path such as hardware.json")
    if os.path.exists(path):
        try:
            return HardwareProfile.load(path), path
        except HardwareError as e:
            raise CalibrateError(f"{path} exists and is not a hardware profile this release reads ({e}); pass "
                                 "another --out, or move that file away") from None
    log(f"no profile at {path} yet: measuring this machine first")
    return profiler.measure(None, log=log), path


def calibrate(dtype: str, steps: int, percentile: float, quick: bool, command: str, out: str | None,
              log: Callable[[str], None], rounds: int = 2) -> tuple[Any, str, list[str]]:
    """Run the calibration models, fit, and return (profile with the calibration, its path, warnings)."""
    from megatrain.planner.shapes import model_shapes
    from megatrain.planner.choice import search
    from megatrain.planner.profiling.calibration import HEAD_SHARE_MAX, SPREAD_WARN, fit
    from megatrain.planner.shapes.workload import Workload
    from megatrain.tools.profile_repair import checked_profile, fit_checked

    hw, path = base_profile(out, log)
    hw = checked_profile(hw, dtype, log)  # a figure of the profile that is off is measured again first
    plain = hw.replace(calibrations=())
    todo = [OVERHEAD_RUN, *(RUNS[:3] if quick else RUNS), SPARSE_RUN]
    plans, measurements = [], []
    for name, config, seq, batch, mbs in todo:
        shape = model_shapes.from_config(config)
        work = Workload(seq_len=seq, batch=batch, compute_dtype=dtype, clipping=True)
        result = search.search(shape, work, plain)
        if result.best is None:
            raise CalibrateError(f"calibration model {name} does not fit this machine ({result.reason()}); "
                                 "free memory and run again")
        # every layer recomputed (the fit's FLOPs), weights copied (bf16: rounded by AdamW), AdamW on its worker;
        # layers eager (the fit's rate is eager's: a compiled plan's layers are timed at it / compiled_layer_speedup)
        plans.append(plan := result.best.plan.replace(micro_batch_size=mbs, kept_layers=(), compute_in_place=False,
                                                      adam_thread="worker", weights_cast="host",
                                                      compiled_layers=False))
        # the overhead run's steps take milliseconds: three times the samples cost next to nothing
        n = 3 * steps if name == OVERHEAD_RUN[0] else steps
        measurements.append((config, seq, batch, dtype, plan.to_json(indent=None), n, steps))

    def progress(r: int, i: int) -> None:
        name, config, seq, batch, _ = todo[i]
        log(f"round {r + 1}/{rounds}: {name}: {model_shapes.params_label(model_shapes.from_config(config).params)} "
            f"params, {batch} x {seq} tokens")

    measured = run_in_rounds(measurements, rounds, progress)

    def reduce_all(h: Any) -> tuple[list[Any], Any]:
        samples = [reduce_run(name, config, seq, batch, dtype, plan, m, h, percentile)
                   for (name, config, seq, batch, _), plan, m in zip(todo, plans, measured)]
        return samples[1:-1], samples[0], samples[-1]  # the layers' runs, the overhead run, the sparse run

    (runs, overhead, sparse), warnings = reduce_all(plain), []
    for r in [overhead, *runs, sparse]:
        if r.spread > SPREAD_WARN:
            warnings.append(f"{r.name}: step times spread {r.spread:.0%} across its samples (a busy machine?); "
                            f"the fit keeps the {'fastest' if percentile == 0 else f'p{percentile:g}'} sample; "
                            "run again on a quiet machine for tighter figures")
        if r.head_s >= HEAD_SHARE_MAX * r.compute_s and r.name != OVERHEAD_RUN[0]:
            warnings.append(f"{r.name}: its head alone took {r.head_s:.3f} s of a {r.compute_s:.3f} s step "
                            "(a busy machine?); the fit counts this run's head with its layers")
        log(f"{r.name}: step {r.step_s:.3f} s (spread {r.spread:.0%}), compute {r.compute_s:.3f} s, "
            f"head alone {r.head_s:.3f} s, peak RSS growth {r.peak_rss_growth_bytes / 2**30:.3f} GiB")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    kept = "best" if percentile == 0 else f"p{percentile:g}"
    source = (f"`{command}` on {when}: {len(todo)} runs x {rounds} rounds x {steps} steps, {kept} of each kept, "
              f"spread up to {max(r.spread for r in [*runs, overhead, sparse]):.0%}")

    def fit_once(h: Any) -> Any:  # the fit with the profile's figures ``h`` (measured again when one is off)
        layers, small, moe = reduce_all(h.replace(calibrations=()))
        return fit(layers, dtype, overhead_run=small, source=source, samples=steps * rounds, sparse_run=moe)

    cal, hw, more = fit_checked(fit_once, hw, log)
    warnings += more
    # The profile's source line, which the planner prints, says the constants are fitted (once).
    base = hw.source.split(FITTED_NOTE)[0].rstrip("; ")
    fitted = ", ".join(sorted({c.compute_dtype for c in hw.calibrations} | {dtype}))
    return (hw.with_calibration(cal).replace(source=f"{base}; {FITTED_NOTE} ({fitted}), latest on {when}"), path,
            warnings)


def save_atomically(hw: Any, path: str) -> None:
    """Write the profile beside ``path`` and rename it over: a crash never leaves half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".hardware-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(hw.to_json() + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def summary(hw: Any, dtype: str, path: str) -> str:
    cal = hw.fitted(dtype)
    widths = ", ".join(f"h={w}: {r:.3f}" for w, r in cal.tflops_by_width)
    return "\n".join([
        f"achieved TFLOP/s ({cal.compute_dtype}) of the layers by width: {widths}",
        f"times t / (t + {cal.t_half_tokens:.0f}) at t tokens per micro-batch; head: "
        + (", ".join(f"h={w}: {r:.3f}" for w, r in cal.head_tflops_by_width) or "with the layers"),
        f"per-block overhead: {cal.block_overhead_s * 1e3:.3f} ms per layer per micro-batch; routed experts at "
        f"{cal.sparse_factor:.2f} x their FLOPs' time at the layers' rate",
        f"AdamW in the step: {cal.adam_params_per_s / 1e9:.3f} Gparam/s; copies: H2D {cal.h2d_gbps:.1f} GB/s, "
        f"D2H {cal.d2h_gbps:.1f} GB/s",
        f"process baseline: {cal.process_bytes / 2**30:.3f} GiB; temporaries: {cal.temporaries_bytes / 2**30:.3f} GiB "
        f"+ {cal.temporaries_factor:.3f} x (working set + logits chunk)",
        f"source: {cal.source}", f"saved to {path}"])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="fp32", help=f"compute dtype to calibrate ({', '.join(DTYPES)}; default fp32)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per model after one warm-up (3)")
    p.add_argument("--percentile", type=float, default=0.0,
                   help="which sample of each figure to keep: 0 the fastest (default), 50 the median")
    p.add_argument("--rounds", type=int, default=2,
                   help="times each model runs, round by round in fresh processes; samples pooled (2)")
    p.add_argument("--quick", action="store_true", help="the three smallest runs only (smoke runs)")
    p.add_argument("--out", help="profile to update or create (default: the saved profile the planner reads, "
                                 "$MEGATRAIN_HARDWARE or ~/.cache/megatrain/hardware.json)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    try:
        if args.dtype not in DTYPES:
            raise CalibrateError(f"--dtype={args.dtype!r} is not one of {', '.join(DTYPES)}")
        if args.steps < 1:
            raise CalibrateError(f"--steps={args.steps} must be 1 or more")
        if args.rounds < 1:
            raise CalibrateError(f"--rounds={args.rounds} must be 1 or more")
        if not 0 <= args.percentile <= 100:
            raise CalibrateError(f"--percentile={args.percentile:g} must be within 0..100")
        if args.out and os.path.isdir(args.out):
            raise CalibrateError(f"--out={args.out!r} is a directory; pass a file path such as hardware.json")
        if args.out and os.path.exists(args.out):
            base_profile(args.out, lambda s: None)  # refuses a file that is not a profile before any run
        log = (lambda s: None) if args.json else (lambda s: print(f"calibrating: {s}", file=sys.stderr, flush=True))
        command = "megatrain-plan calibrate" + "".join(f" {shlex.quote(a)}" for a in (argv if argv is not None
                                                                                     else sys.argv[1:]))
        hw, out, warnings = calibrate(args.dtype, args.steps, args.percentile, args.quick, command, args.out, log,
                                      args.rounds)
        save_atomically(hw, out)
    except MegatrainError as e:  # ours, the hardware profile's, the fit's: one line, exit 2
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    for w in warnings:
        print(f"{PROG}: warning: {w}", file=sys.stderr)
    if args.json:
        print(json.dumps({"calibration": hw.fitted(args.dtype).to_dict(), "saved_to": out, "warnings": warnings},
                         indent=2, sort_keys=True))
    else:
        print(summary(hw, args.dtype, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
