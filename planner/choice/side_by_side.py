"""Independent planner work side by side: jobs in forked processes, as many as the cores this process may run on.

The search prices a few hundred candidates, and ``megatrain-plan ram`` runs a search per row of its RAM ladder; each
is independent of the others and pure arithmetic in one thread, so on a machine with more than one core they run
apart, in processes forked from this one (no re-import, nothing to send but the arguments and the results). The
results are the ones the jobs give one after another: only where they run changes.

A fork copies only the calling thread, so a lock another thread holds would stay held in the child: where this
process has another thread, or cannot fork, or a job runs inside a worker already (a search inside a ``ram`` row),
the jobs run in turn. Pure stdlib.

[Note: frozen before the fork]: a worker inherits every object of this process (the imported modules, the memory
estimates kept so far; in a test run or a training process, torch's and transformers' objects too), and each of its
full garbage collections would walk them all, touching their pages, which the fork then copies. ``run_apart``
freezes them (``gc.freeze``: moved out of the collector's generations) for the pool's life and thaws them after, so
a worker collects only what it made. Measured on the 2-core development machine: the overview of every preset on
an RTX-4090, in a test process that had loaded transformers' models, took 6.2-6.7 s against 8.2-8.3 s; the
``megatrain-plan`` command alone, whose process holds few objects, is as fast either way.
"""
from __future__ import annotations

import concurrent.futures
import gc
import multiprocessing
import os
import threading
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")

_in_worker = False  # True in a forked worker: its jobs' own jobs run in turn there


def _mark_worker() -> None:
    global _in_worker
    _in_worker = True


def workers(jobs: int) -> int:
    """How many processes ``jobs`` jobs would run in: the cores this process may run on (at most one a job) where
    forking is safe here, else 1."""
    if _in_worker or threading.active_count() > 1 or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(jobs, cores))


def run_apart(jobs: Sequence[tuple[Callable[..., Any], tuple]]) -> list[Any]:
    """Each ``(function, arguments)``'s result, in order: in ``workers(len(jobs))`` forked processes where that is
    more than one, else one after another here."""
    n = workers(len(jobs))
    if n < 2:
        return [function(*arguments) for function, arguments in jobs]
    gc.freeze()  # the workers' collections skip every object they inherit ([Note: frozen before the fork])
    try:
        with concurrent.futures.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork"),
                                                    initializer=_mark_worker) as pool:
            futures = [pool.submit(function, *arguments) for function, arguments in jobs]
            return [f.result() for f in futures]
    finally:
        gc.unfreeze()


def dealt(items: Sequence[T], least: int) -> list[list[tuple[int, T]]]:
    """``items`` with their indices, dealt round-robin into one hand per worker (neighbouring items cost alike, so
    each hand gets its share of the dear ones), each hand at least ``least`` items; one hand where there are fewer
    items than two hands need, or one worker."""
    hands = min(workers(len(items)), max(1, len(items) // max(1, least)))
    indexed = list(enumerate(items))
    return [indexed[k::hands] for k in range(hands)]
