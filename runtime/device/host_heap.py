"""The process's C heap: keep the memory a step frees for the next step instead of handing it back to the kernel.

[Note: freed heap]
torch's CPU tensors come from the C library's malloc. glibc gives freed memory back to the kernel as soon as more
than its trim threshold lies free at the top of the heap, and that threshold adapts only up to 64 MiB. A training
step on a CPU device frees more than that at its end (its activations), and the next step takes every page again
through a page fault that zeroes it: a 25.8M model's step (4 x 128 tokens, fp32, every layer kept) took 15,000-
17,000 page faults and 24-30 ms of kernel time a step, plain PyTorch's 8,000.

``keep_freed_heap`` sets the thresholds once for the process: the heap gives memory back only when more than
``TRIM_THRESHOLD`` lies free at its top, and allocations above ``MMAP_THRESHOLD`` (glibc's own adaptive ceiling)
are still their own mappings, as glibc places them once it has adapted: the arenas of host state, and the largest
temporaries. The same model's step then took 60-140 faults and no kernel time (0.401-0.412 s against 0.416-0.420
in the same runs). What the process keeps is memory it had already used in the step: the peak resident memory of
a 100.7M model's steps was the same with and without (2.367 against 2.368 GiB), and so is every figure of the
memory model. PyTorch's own CPU launcher (``torch.backends.xeon.run_cpu``) does as much with jemalloc, whose
decay times it sets so that freed memory is never returned.

It is a setting of the whole process, so the runtime never makes it: ``megatrain-train`` calls it at start (the
process is its own), and a user's own loop may call it (``megatrain.runtime.keep_freed_heap``).

May import: the standard library; nothing else of megatrain.
"""
from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD = -1   # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20       # glibc's own adaptive ceiling: above it a fresh mapping, as glibc would place it
TRIM_THRESHOLD = (1 << 31) - 1  # the largest the C int of mallopt takes: 2 GiB free at the heap's top before a trim


def keep_freed_heap() -> bool:
    """Set the process's malloc thresholds ([Note: freed heap]); False where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False  # musl's mallopt does nothing; macOS and Windows have no mallopt
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
