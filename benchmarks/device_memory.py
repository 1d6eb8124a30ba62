"""The planner's device memory against the GPU's, from the runs already recorded.

    python benchmarks/device_memory.py                      # every recorded run on an H200
    python benchmarks/device_memory.py --device H100 --results DIR

Reads every megatrain run in ``<results>/*_<device>_step_anatomy_*.json`` and ``*_<device>_peers.json`` that
recorded its plan and its peak GPU memory, and prices the run's plan with the planner
(``memory_model.estimate`` with the GPU preset of that name; the device terms do not depend on the
calibration). Per run: the planner's tensors (its device terms before allocator slack and the CUDA context),
their error against the peak allocated bytes, the planner's whole figure against the peak reserved bytes, and
the alternative of counting only the largest of the step's phases instead of their sum:

  loss                   kept activations + logits chunk
  kept layer's backward  kept activations + t x (w - a) + layer x c + attention working set (its forward's
                         tensors are among the kept already; w: the layer working set per token, a: a kept
                         layer's bytes per token)
  recomputed layer's     layer working set + attention working set (the kept layers, all after it, are freed)

Writes ``<out>/<date>_<device>_device_memory.{json,md}``. Nothing runs on a GPU: this re-prices what ran.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from peer_runners.spec import model_config  # noqa: E402
from result_files import write_report  # noqa: E402

GiB = 2**30
PHASE_TERMS = ("kept activations", "layer working set", "attention working set", "logits chunk")
FIXED = ("allocator slack", "CUDA context")


def recorded_runs(results: str, device: str) -> list[dict]:
    """(source, label, model, layers, seq, batch, clipping, plan, allocated, reserved) of every megatrain run with
    a plan and a peak."""
    runs = []
    for path in sorted(glob.glob(os.path.join(results, f"*_{device}_step_anatomy_*.json"))):
        for r in _runs(path):
            if r.get("plan") and r.get("peak_gpu_bytes"):
                runs.append(dict(source=os.path.basename(path), label=r["variant"], model=r["model"],
                                 layers=r.get("layers"), seq=r["seq"], batch=r["batch"],
                                 clipping=r.get("clipping", True), plan=r["plan"], allocated=r["peak_gpu_bytes"],
                                 reserved=r.get("peak_gpu_reserved_bytes") or None))
    for path in sorted(glob.glob(os.path.join(results, f"*_{device}_peers.json"))):
        for r in _runs(path):
            plan = (r.get("details") or {}).get("plan")
            if r["system"] == "megatrain" and r["status"] == "ok" and plan and r.get("peak_gpu_bytes"):
                runs.append(dict(source=os.path.basename(path), label="peers", model=r["model"].split("@")[0],
                                 layers=r.get("layers"), seq=r["seq"], batch=r["batch"], clipping=True, plan=plan,
                                 allocated=r["peak_gpu_bytes"], reserved=r.get("peak_gpu_reserved_bytes") or None))
    return runs


def _runs(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)["runs"]


def priced(run: dict, hw) -> dict:
    """The planner's figures for one recorded run (see the module docstring)."""
    from megatrain.planner.costs import kept_layers, memory_model
    from megatrain.planner.shapes import model_shapes
    from megatrain.plan.plan import Plan
    from megatrain.planner.shapes.workload import Workload

    shape = model_shapes.from_config(model_config(run["model"], run["layers"], run["seq"]))
    plan = Plan.from_dict(run["plan"])
    work = Workload(seq_len=run["seq"], batch=run["batch"], clipping=run["clipping"])
    est = memory_model.estimate(shape, work, plan, hw)
    device = {c.name: c.nbytes for c in est.components if c.where == "device"}
    tensors = sum(v for k, v in device.items() if k not in FIXED)
    common = tensors - sum(device.get(k, 0) for k in PHASE_TERMS)
    kept, layer = device.get("kept activations", 0), device["layer working set"]
    attention, logits = device["attention working set"], device["logits chunk"]
    t = min(plan.micro_batch_size, work.batch) * work.seq_len
    w = shape.layer_working_bytes_per_token(work.compute_dtype)
    a = kept_layers.kept_bytes_per_token(shape, work.compute_dtype)
    phases = {"loss": kept + logits}
    if plan.kept_layers:
        phases["kept layer's backward"] = kept + t * max(0, w - a) + (layer - t * w) + attention
    if kept_layers.recomputed_layers(shape, plan):
        phases["recomputed layer's backward"] = layer + attention
    largest = max(phases, key=phases.get)
    return dict(run, planner_bytes=est.device_bytes, tensors_bytes=tensors, phases_bytes=common + phases[largest],
                largest_phase=largest)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--results", default=os.path.join(HERE, "results"), help="where the recorded runs are")
    p.add_argument("--device", default="H200", help="the GPU preset and the results' device label (H200)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    from megatrain.planner.profiling import hardware

    try:
        hw = hardware.preset(args.device)
    except hardware.HardwareError as e:  # an unknown preset: one line
        print(f"device_memory: error: {e}", file=sys.stderr)
        return 2
    runs = [priced(r, hw) for r in recorded_runs(args.results, args.device)]
    if not runs:
        print(f"device_memory: error: no recorded {args.device} run with a plan and a peak under {args.results}",
              file=sys.stderr)
        return 2
    lines = [f"# The planner's device memory against {len(runs)} recorded {args.device} runs", "",
             "Tensors: the planner's device terms before allocator slack and the CUDA context, against the peak "
             "allocated bytes; planner: its whole figure against the peak reserved bytes; phases: the common terms "
             "plus the largest phase alone (benchmarks/device_memory.py). A step anatomy's variants share one "
             "process: a later one's reserved peak holds what the allocator cached for the earlier ones.", "",
             "| run | model | seq x batch | allocated GiB | reserved GiB | tensors GiB (error) | planner GiB (vs "
             "reserved) | largest phase only GiB (error) |", "|---|---|---|---|---|---|---|---|"]

    def err(a: float, b: float | None) -> str:
        return "-" if not b else f"{a / b - 1:+.1%}"

    for r in runs:
        reserved = f"{r['reserved'] / GiB:.2f}" if r["reserved"] else "-"
        lines.append(f"| {r['source'][:10]} {r['label']} | {r['model']} | {r['seq']} x {r['batch']} | "
                     f"{r['allocated'] / GiB:.2f} | {reserved} | {r['tensors_bytes'] / GiB:.2f} "
                     f"({err(r['tensors_bytes'], r['allocated'])}) | {r['planner_bytes'] / GiB:.1f} "
                     f"({err(r['planner_bytes'], r['reserved'])}) | {r['phases_bytes'] / GiB:.2f} "
                     f"({err(r['phases_bytes'], r['allocated'])}, {r['largest_phase']}) |")
    write_report(os.path.join(args.out, f"{datetime.date.today().isoformat()}_{args.device}_device_memory"),
                 {"device": args.device, "hardware": hw.source, "runs": runs}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
