"""What glibc's heap keeps of a CPU device's freed step temporaries: a host term of the memory model
(memory_model.estimate adds it when the device is the host and no calibration fitted the temporaries).

Pure stdlib.
"""
from __future__ import annotations

from megatrain.planner.shapes.model_shapes import ModelShape

# glibc's malloc: its mmap threshold rises to the largest freed mmapped chunk, up to this (DEFAULT_MMAP_THRESHOLD_MAX
# on 64-bit); larger chunks are always mmapped, and unmapped when freed.
GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20


def allocator_retention(model: ModelShape, c: int) -> tuple[int, str]:
    """[Note: allocator retention]
    On a CPU device the step's temporaries are host memory from glibc's malloc, whose mmap threshold is dynamic:
    once a temporary it had mmapped is freed, temporaries up to that size come from the heap, which keeps up to
    twice that free at its top (the trim threshold follows at 2x) and, as the step's mix of sizes recurs, holes
    between live tensors. The largest temporary a step frees, T, is a whole matrix's gradient from autograd: the
    embedding's dense gradient or the head's weight gradient, V x h x c, or a layer's largest, I x h x c (the rise
    stops at GLIBC_MMAP_THRESHOLD_MAX: larger chunks are always mmapped and unmapped):

      2 x 2 x min(max(V, I) x h x c, 32 MiB)   (the trim threshold at the heap's top, and as much again in holes)

    The same at any W (a rank's temporaries are one micro-batch's). The second 2 is fitted: on a 33M-parameter
    model (V 8192, h 512, fp32: T = 16 MiB, the term 64 MiB) the peak RSS of CPU ranks was 66-118 MiB above the
    listed buffers at W = 1, 2, 3 over four runs (35-91 MiB of it gone with the threshold fixed at 4 MiB, which
    costs the step 9-11% CPU time in page faults: not done). On a GPU the temporaries are the device's (allocator
    slack)."""
    h, V, I = model.hidden_size, model.vocab_size, model.intermediate_size
    kept = min(max(V, I) * h * c, GLIBC_MMAP_THRESHOLD_MAX)
    return 4 * kept, (f"2 x 2 x min(max(V, I) x h x c, 32 MiB) = 4 x min({max(V, I)} x {h} x {c}, "
                      f"{GLIBC_MMAP_THRESHOLD_MAX}) (glibc's heap: its top below the trim threshold, as much in holes)")
