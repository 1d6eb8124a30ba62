"""Helper threads and the intra-op (OpenMP) threads their tensor work uses.

[Note: helper threads]
torch's CPU kernels run on an OpenMP team that belongs to the thread calling them. A helper thread (the AdamW
worker) that runs a parallel kernel gets a team of its own, as large as the process's intra-op thread count, and
keeps it while it lives. Two teams make more OpenMP threads than cores, and libgomp then stops spinning between
parallel regions: every kernel of the compute thread wakes its team through the kernel's futex. Where the device
is the CPU that made the step's element-wise kernels 3-10x slower on a 2-core machine (a 25.8M model's step:
0.48 s to 0.44 s once the worker ran on one thread), and plain PyTorch in the same process slowed as much.

The rule: where the device is the CPU, the compute thread owns every core, so a helper runs its kernels on one
thread (no team). On a GPU machine the compute thread only launches kernels and the AdamW worker keeps every
core. The planner's AdamW rate follows the same rule (``HardwareProfile.adam_params_per_s``). Where the device is
the CPU and nothing spills there is nothing for a worker to overlap, so plans put AdamW on the compute thread
itself (``Plan.adam_thread == "compute"``: no worker, every core, the profile's all-core rate).

``torch.set_num_threads`` sets the calling thread's OpenMP count and also the count that every thread takes on
its first parallel kernel. ``start`` therefore has the helper initialise its own count before setting it to one
(or its first kernel would undo it), and then puts the shared count back from the starting thread, whose own
count it reads before the helper starts.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch


def start(target: Callable[[], None], name: str, one_thread: bool, daemon: bool = True) -> threading.Thread:
    """Start ``target`` in a new thread named ``name``; ``one_thread``: its kernels run on one intra-op thread.

    Returns once the new thread has set its count, so the caller's and later threads' counts are as before."""
    count = torch.get_num_threads()  # this thread's, initialised now if it was not yet
    ready = threading.Event()

    def run() -> None:
        if one_thread:
            torch.get_num_threads()  # initialise this thread's count, so its first kernel does not reset it
            torch.set_num_threads(1)
        ready.set()
        target()

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    ready.wait()
    if one_thread:
        torch.set_num_threads(count)  # the count new threads start from, as it was; this thread's is unchanged
    return thread
