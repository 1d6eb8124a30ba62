"""What spill I/O costs the CPU: seconds of compute the cores lose for each GB the disk moves.

A spilled step's reads and writes are not free for the CPU even with O_DIRECT: the kernel (and, on a virtual
disk, the hypervisor's queue on the same cores) spends cycles on each request. On this project's 2-core
machine a matmul ran 17% slower beside O_DIRECT reads at 1.0 GB/s and 36% slower beside writes at 2.5 GB/s
(0.14-0.17 s of compute per GB), and this probe's mixed reads and writes measure 0.08-0.125 s per GB; the spilled
34M model's compute took 1.42-1.47 s a step against 1.27-1.31 unspilled. The cost model adds
``disk_cpu_s_per_gb`` x the bytes a transfer moves to the CPU work beside it where the device is the CPU
(``spill_timing``). Pure stdlib.

The probe: units of ``work`` on every core (the profiler passes a torch matmul) alone, then beside ``threads``
threads (half reading, half writing a file under ``directory`` in ``request``-byte requests, each thread its own
buffer with no two pages alike, O_DIRECT where ``direct``), then alone again:
    lost_s = seconds x (1 - rate_beside / mean(rate_alone before, after))
    disk_cpu_s_per_gb = lost_s / (GB moved in those seconds)
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
from typing import Callable

from megatrain.planner.profiling.host_probe import DISK_REQUEST_BYTES, io_buffers


def cpu_seconds_per_gb(directory: str, direct: bool, work: Callable[[], object], seconds: float = 2.0,
                       threads: int = 4, request: int = DISK_REQUEST_BYTES,
                       file_bytes: int = 8 * DISK_REQUEST_BYTES) -> float:
    """CPU seconds lost per GB of disk traffic (module docstring); 0.0 when the disk moved nothing. ``work``: one
    unit of compute on every core (the profiler passes a 512 x 512 fp32 matmul)."""

    def matmul_rate() -> float:  # units of work per second over ``seconds``
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            work()
            n += 1
        return n / (time.perf_counter() - t0)

    fd, path = tempfile.mkstemp(prefix="megatrain-contention-", dir=directory)
    bufs = io_buffers(threads, request)  # a buffer per stream, no two pages alike, as the spill backend's
    stop, moved, lock = threading.Event(), [0], threading.Lock()
    try:
        for i in range(file_bytes // request):
            os.pwrite(fd, bufs[i % threads], i * request)
        os.fsync(fd)
        if direct:
            os.close(fd)
            fd = os.open(path, os.O_RDWR | os.O_DIRECT)

        def stream(op, first: int) -> None:
            i = first
            while not stop.is_set():
                done = op(fd, [bufs[first]], (i % (file_bytes // request)) * request)
                with lock:
                    moved[0] += done
                i += 1

        for _ in range(10):  # warm-up
            work()
        before = matmul_rate()
        workers = [threading.Thread(target=stream, args=(os.preadv if k % 2 == 0 else os.pwritev, k))
                   for k in range(threads)]
        for w in workers:
            w.start()
        t0 = time.perf_counter()
        beside = matmul_rate()
        elapsed, moved_then = time.perf_counter() - t0, moved[0]
        stop.set()
        for w in workers:
            w.join()
        after = matmul_rate()
    finally:
        stop.set()
        os.close(fd)
        os.unlink(path)
        for buf in bufs:
            buf.close()
    gb = moved_then / 1e9
    lost = elapsed * max(0.0, 1.0 - beside / ((before + after) / 2))
    return lost / gb if gb > 0 else 0.0
