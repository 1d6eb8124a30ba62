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

Ranks of a data-parallel run on one node share its cores: the planner times each rank's AdamW at the all-core
rate over the G ranks of a node (``data_parallel``'s "x G"). Under ``torchrun --nproc-per-node G`` every rank starts
with ``OMP_NUM_THREADS=1`` (torchrun sets it where it is unset), which would leave each rank's AdamW on one core;
with no variable at all, each rank would take every core and G teams would fight over them. So a rank's AdamW
worker on a GPU runs its kernels on its share of the physical cores (``helper_threads``; torch's own count for one
process is the physical cores too): those among the CPUs a launcher bound it to, or the node's over G where it bound
none; a count the user gave in ``OMP_NUM_THREADS`` other than torchrun's 1 is kept.

``torch.set_num_threads`` sets the calling thread's OpenMP count and also the count that every thread takes on
its first parallel kernel. ``start`` therefore has the helper initialise its own count before setting its own
(or its first kernel would undo it), and then puts the shared count back from the starting thread, whose own
count it reads before the helper starts.
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Mapping

import psutil
import torch


def helper_threads(cuda: bool, local_ranks: int, environ: Mapping[str, str] = os.environ,
                   affinity: int | None = None, cpu_count: int | None = None,
                   physical: int | None = None) -> int | None:
    """The intra-op threads of a helper that runs CPU kernels beside the step ([Note: helper threads]): 1 where the
    device is the CPU; on a GPU, None (the process's count) for one process or where ``OMP_NUM_THREADS`` names a
    count other than 1, else this rank's share of its node's physical cores (``physical``; torch's own count for one
    process) among ``local_ranks``: those of the logical CPUs it may run on (``affinity``: ``os.sched_getaffinity``)
    where a launcher bound it to fewer than the machine's (``cpu_count``), else the machine's over ``local_ranks``."""
    if not cuda:
        return 1
    if local_ranks <= 1 or environ.get("OMP_NUM_THREADS", "1").strip() not in ("", "1"):
        return None
    cpu_count = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    physical = physical if physical is not None else (psutil.cpu_count(logical=False) or cpu_count)
    if affinity is None:
        affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpu_count
    if affinity < cpu_count:  # bound by its launcher: the physical cores among its CPUs
        return max(1, affinity * physical // cpu_count)
    return max(1, physical // local_ranks)


def start(target: Callable[[], None], name: str, threads: int | None, daemon: bool = True) -> threading.Thread:
    """Start ``target`` in a new thread named ``name``; ``threads``: its kernels' intra-op threads (None: the
    process's count).

    Returns once the new thread has set its count, so the caller's and later threads' counts are as before."""
    count = torch.get_num_threads()  # this thread's, initialised now if it was not yet
    ready = threading.Event()

    def run() -> None:
        if threads is not None:
            torch.get_num_threads()  # initialise this thread's count, so its first kernel does not reset it
            torch.set_num_threads(threads)
        ready.set()
        target()

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    ready.wait()
    if threads is not None:
        torch.set_num_threads(count)  # the count new threads start from, as it was; this thread's is unchanged
    return thread
