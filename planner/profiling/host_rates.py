"""The host's own rates, measured with torch on its CPU threads (``megatrain-plan profile``, via profiler.py):
CPU AdamW, the compute-dtype shadow's rounding, bf16 AdamW state's extra pass, host memcpy.

Like profiler.py, it imports torch only inside the functions that measure.
"""
from __future__ import annotations

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


def cpu_bf16_state_rate(numel: int, threads: int) -> float:
    """Params/s of the pass bf16 AdamW state adds to an update, on ``threads`` threads, with the torch calls of
    the runtime's stochastic_rounding.py: in chunks of 2^17 elements per thread, m and v widened to fp32 scratch,
    a slice of a 2^16-entry table of 16-bit noise added to their bits (one table period repeated over the chunk),
    the low halves masked off, both narrowed back."""
    import torch
    before = torch.get_num_threads()
    period = 1 << 16
    chunk = min(1 << 20, 2 * period * (1 << max(0, threads - 1).bit_length()))  # at most a piece
    numel = max(chunk, numel - numel % chunk)  # whole chunks
    m, v = torch.randn(numel).bfloat16(), torch.randn(numel).bfloat16()
    table = torch.randint(0, period, (4 * period,), dtype=torch.int32)
    mask = torch.tensor(-period, dtype=torch.int32)

    def once() -> float:
        scratch = torch.empty(2, chunk)
        t0 = time.perf_counter()
        for a in range(0, numel, chunk):
            scratch[0].copy_(m[a:a + chunk])
            scratch[1].copy_(v[a:a + chunk])
            noise = table.as_strided((2, chunk // period, period), (2 * period + 77, 0, 1), 123)
            bits = scratch.view(torch.int32)
            bits.view(2, chunk // period, period).add_(noise)
            bits.bitwise_and_(mask)
            m[a:a + chunk].copy_(scratch[0])
            v[a:a + chunk].copy_(scratch[1])
        return time.perf_counter() - t0

    try:
        torch.set_num_threads(threads)
        for _ in range(2):  # the first calls fault their buffers' pages in
            once()
        return numel / best_of(once, 3)
    finally:
        torch.set_num_threads(before)


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
