"""The host's own rates, measured with torch on its CPU threads (``megatrain-plan profile``, via profiler.py):
CPU AdamW, the compute-dtype shadow's rounding, AdamW with bf16 state (the runtime's pass, in a child process),
host memcpy.

Like profiler.py, it imports torch only inside the functions that measure.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Callable

from megatrain.planner.profiling import profile_checks
from megatrain.planner.profiling.hardware import MiB


def best_of(fn: Callable[[], float], repeats: int) -> float:
    """The fastest of ``repeats`` samples, measured again while a round spreads too far
    ([profile_checks.steady_minimum])."""
    return profile_checks.steady_minimum(lambda: [fn() for _ in range(repeats)], "a sample", lambda line: None)


def cpu_shadow_rate(numel: int) -> float:
    """Params/s of rounding fp32 into bf16 on the CPU (all threads): the runtime's shadow refresh."""
    import torch
    src, dst = torch.randn(numel), torch.empty(numel, dtype=torch.bfloat16)

    def once() -> float:
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    once()
    return numel / best_of(once, 3)


def cpu_bf16_state_rate(numel: int, threads: int, fp32_rate: float | None = None) -> float:
    """Params/s of the AdamW update with bf16 m and v (the runtime's one pass: widen, update, round back,
    runtime/optim/bf16_adamw.py) over ``numel`` elements on ``threads`` threads; 0.0 where it could not run. In a
    child process (``python -m megatrain.tools.bf16_state_probe``: the planner never imports the runtime), which
    times it alternated with torch's fused fp32 AdamW. With ``fp32_rate`` (fp32 AdamW's params/s measured here on
    those threads): that rate x the child's bf16 / fp32 ratio, so a profile's two figures compare as the two
    updates did side by side, however busy the machine was between them."""
    cmd = [sys.executable, "-m", "megatrain.tools.bf16_state_probe", "--numel", str(numel), "--threads", str(threads)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return 0.0
        got = json.loads(done.stdout.strip().splitlines()[-1])
        bf16, fp32 = float(got["params_per_s"]), float(got["fp32_params_per_s"])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError, TypeError):
        return 0.0
    return bf16 if fp32_rate is None else fp32_rate * bf16 / fp32


def cpu_adam_rate(numel: int, threads: list[int]) -> list[tuple[int, float]]:
    """(threads, params/s) of torch's fused CPU AdamW over one flat fp32 buffer: the runtime's optimizer."""
    import torch
    before = torch.get_num_threads()
    p, g = torch.zeros(numel), torch.randn(numel)
    m, v, step = torch.zeros(numel), torch.zeros(numel), torch.tensor(0.0)

    def once() -> float:
        step.add_(1)
        t0 = time.perf_counter()
        torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
        return time.perf_counter() - t0

    out = []
    try:
        for n in threads:
            torch.set_num_threads(n)
            once()
            out.append((n, numel / best_of(once, 3)))
    finally:
        torch.set_num_threads(before)
    return out


def cpu_copy_gbps(nbytes: int = 64 * MiB) -> float:
    """Host memcpy GB/s: the 'transfer' rate when the device is the CPU."""
    import torch
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)

    def once() -> float:
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0
    return nbytes / best_of(once, 3) / 1e9


def adam_bytes_per_param(state_bytes: int = 4) -> int:
    """Bytes one AdamW update moves per parameter through host memory, with m and v of ``state_bytes`` each
    (4 for fp32, 2 for bf16): the fp32 master read and written (8), the fp32 gradient read (4), m and v each
    read and written (4 x state_bytes): 28 for fp32 state, 20 for bf16 (whose fp32 scratch stays in cache)."""
    return 4 + 4 + 4 + 4 * state_bytes


def cpu_memory_gbps(numel: int, threads: int) -> float:
    """Host memory GB/s of a triad on ``threads`` threads: a = b + 0.5 x c over three fp32 arrays of ``numel``
    elements (beyond the caches), 12 bytes moved per element (two reads, one write; the write's cache-line
    fill not counted, as AdamW's bytes are not)."""
    import torch
    before = torch.get_num_threads()
    a, b, c = torch.empty(numel), torch.rand(numel), torch.rand(numel)

    def once() -> float:
        t0 = time.perf_counter()
        torch.add(b, c, alpha=0.5, out=a)
        return time.perf_counter() - t0

    try:
        torch.set_num_threads(threads)
        once()  # faults a's pages in
        return 12 * numel / best_of(once, 3) / 1e9
    finally:
        torch.set_num_threads(before)
