"""The host allocator's hold on freed temporaries: a fixed mmap threshold, so a block-sized temporary goes back
to the system when freed instead of staying in the process's heap.

[Note: host allocator threshold]
torch's CPU tensors come from glibc's malloc. By default glibc's mmap threshold is dynamic: the first time a
large mmapped chunk is freed, the threshold rises to that chunk's size (up to 32 MiB) and the heap's trim
threshold to twice it, so from then on every temporary below it (a layer's weight gradients from autograd,
3-16 MiB each on a 33M-parameter model; the embedding's dense gradient and the head's weight gradient, a
whole block each) is carved from the heap, and the heap keeps what fragmentation and the trim threshold leave
it. Measured on a 33M-parameter model (8 layers, 8k vocabulary, CPU ranks): peak RSS 50-75 MiB above the
live tensors' peak, at every world size (a rank's temporaries are a micro-batch's, the same at any W).

Fixing the threshold at ``MMAP_THRESHOLD_BYTES`` (4 MiB) ends the rise: temporaries of 4 MiB and more are
mmapped and unmapped when freed; smaller ones still come from the heap, reused at once (the same sizes
recur every micro-batch), and the heap top above 128 KiB is trimmed. Measured on the same model: peak RSS
933-946 MiB against 970-989 MiB by default (W = 1; the planner's figure 918 MiB), step time unchanged within
the machine's noise (a 128 KiB threshold, glibc's initial one, would be 30% slower: it re-faults every
temporary every step). The trim threshold is set back to glibc's initial 128 KiB as well (the rise may have
raised it before the first engine). What the heap still keeps of the smaller temporaries (20-30 MiB on that
model) is not modelled: the planner's figure is 3-5% under the measured peak at W = 1, 2, 3.

Process-wide and set once, by the first engine of the process; a MALLOC_MMAP_THRESHOLD_ or
MALLOC_TRIM_THRESHOLD_ in the environment (the user's own choice) is left alone, as is any libc other than
glibc.
"""
from __future__ import annotations

import ctypes
import os
import platform

MMAP_THRESHOLD_BYTES = 4 * 2**20
TRIM_THRESHOLD_BYTES = 128 * 2**10  # glibc's DEFAULT_TRIM_THRESHOLD
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
_done = False


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at ``MMAP_THRESHOLD_BYTES`` (once per process); whether it is now fixed by us."""
    global _done
    if _done:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(k in os.environ for k in _USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL(None)
        _done = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                     and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False
    return _done
