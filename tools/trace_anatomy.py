"""Where traced steps spent their time, read from a torch.profiler trace: the roofline's four resources.

The runtime labels its work per block: ``fwd[b]``, ``head[b]``, ``bwd[b]`` (compute, main
thread), ``h2d[b]`` and ``d2h[b]`` (copies issued), ``adam[b]`` (the worker's update, its waits
for drains and disk reads left outside). From a trace of whole steps this sums, per step:

- on CUDA: compute = the device's kernels (copies and memsets excluded), H2D and D2H = the
  device's ``Memcpy HtoD`` / ``Memcpy DtoH`` records; on a CPU, where copies run in program
  order on the host: compute = the compute ranges less the copies issued inside them, H2D and
  D2H = the copy ranges' host time;
- AdamW = the worker's ``adam[b]`` ranges (host time on both); ``shadow_s``, the part of it that
  rounds the fp32 master into the compute-dtype shadow (``shadow[b]``, bf16 compute only).

Overlapping records of one kind count once (interval union). ``roofline_s`` is the largest of
the four: the step a perfect overlap would take; ``roofline_ratio`` = measured step / roofline.
AdamW traced on the compute thread itself (``Plan.adam_thread == "compute"``) cannot overlap
compute: its seconds add to compute's there (``bound_by`` "compute+adam").
The worker thread is traced only where torch.profiler can trace threads it did not start in
(``profile_all_threads``); ``adam_traced`` says whether it was.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

COMPUTE_LABELS = ("fwd[", "head[", "bwd[")


def profile_kwargs(cuda: bool) -> dict[str, Any]:
    """Arguments for ``torch.profiler.profile`` that trace the AdamW worker thread too, where possible."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    kwargs: dict[str, Any] = {"activities": activities, "record_shapes": False}
    try:
        kwargs["experimental_config"] = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # an older torch: the main thread only
        pass
    return kwargs


def union_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds in, seconds out)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total / 1e6


def _intersection_seconds(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Length of union(xs) ∩ union(ys), in seconds."""
    return union_seconds(xs) + union_seconds(ys) - union_seconds(xs + ys)


def anatomy(events: Iterable[Any], steps: int, step_seconds: float) -> dict[str, Any]:
    """Per-step seconds of each resource in ``events`` (a profiler's ``events()``) covering ``steps``
    whole steps whose measured mean is ``step_seconds``."""
    host: dict[str, list[tuple[float, float]]] = {k: [] for k in ("compute", "h2d", "d2h", "adam", "shadow")}
    threads: dict[str, set[int]] = {"compute": set(), "adam": set()}  # which threads ran compute and AdamW
    device: dict[str, list[tuple[float, float]]] = {k: [] for k in ("compute", "h2d", "d2h")}
    for ev in events:
        span = (ev.time_range.start, ev.time_range.end)
        name = ev.name
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            if name.startswith("Memcpy HtoD"):
                device["h2d"].append(span)
            elif name.startswith("Memcpy DtoH"):
                device["d2h"].append(span)
            elif not name.startswith(("Memcpy", "Memset")):
                device["compute"].append(span)
        elif name.startswith(COMPUTE_LABELS):
            host["compute"].append(span)
            threads["compute"].add(ev.thread)
        elif name.startswith(("h2d[", "d2h[", "adam[", "shadow[")):
            host[name[:name.index("[")]].append(span)
            if name.startswith("adam["):
                threads["adam"].add(ev.thread)
    cuda = bool(device["compute"])
    if cuda:
        compute = union_seconds(device["compute"])
        h2d, d2h = union_seconds(device["h2d"]), union_seconds(device["d2h"])
    else:
        copies = host["h2d"] + host["d2h"]
        compute = union_seconds(host["compute"]) - _intersection_seconds(host["compute"], copies)
        h2d, d2h = union_seconds(host["h2d"]), union_seconds(host["d2h"])
    adam = union_seconds(host["adam"])
    per_step = {"compute_s": compute / steps, "h2d_s": h2d / steps, "d2h_s": d2h / steps, "adam_s": adam / steps}
    resources = {k[:-2]: v for k, v in per_step.items()}
    if threads["adam"] & threads["compute"]:  # AdamW on the compute thread: in series with compute
        resources["compute+adam"] = resources.pop("compute") + resources.pop("adam")
    roofline = max(resources.values())
    return {**per_step, "step_s": step_seconds, "roofline_s": roofline,
            "roofline_ratio": step_seconds / roofline if roofline > 0 else None,
            "bound_by": max(resources, key=resources.get), "source": "cuda" if cuda else "cpu",
            "shadow_s": union_seconds(host["shadow"]) / steps,
            "adam_traced": bool(host["adam"])}
