"""Spawn W ranks of a CPU (gloo) process group running one function, with timeouts so nothing hangs.

``run_ranks(fn, world, tmp_path, *args)`` starts ``world`` processes, each joins a gloo group over a file
store in ``tmp_path`` (every collective times out after ``COLLECTIVE_TIMEOUT_S``), calls ``fn(rank, world,
*args)`` and returns the list of the ranks' return values (pickled through files). A rank that raises fails
the test with its traceback; ranks still running after ``timeout_s`` are killed and fail it too.

Each rank is a fresh process forked from one fork server per test session (``multiprocessing``'s
"forkserver"), which imported torch and megatrain once before forking anything: a spawned rank spent about
3 s of CPU importing them again, some 60 times a suite. The server never runs a tensor operation (no thread
pool to inherit) and each rank starts from its state, never another rank's or another test's; the rank takes
the test's environment variables, working directory and ``sys.path`` as they are when it starts.
``start="spawn"`` runs a rank in a new interpreter instead, for a test that needs the process as a new
interpreter leaves it.
"""
from __future__ import annotations

import datetime
import os
import pickle
import time
import traceback

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60.0
# What the fork server imports before it forks a rank: what every rank's function imports, the costly part of
# a rank's start; and what torch imports at a rank's first backward with explicit gradients (autograd's shape
# checks import torch.fx.experimental.symbolic_shapes and sympy: about a second of CPU a rank).
PRELOAD = ["torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes", "megatrain.runtime",
           "megatrain.tools.train", "rank_processes"]


def _child(rank: int, world: int, root: str, fn, args, collective_timeout_s: float,
           environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)  # the test's, as a spawned rank has it; the fork server's are its start's
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the CI machine has few cores for several ranks
    try:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(root, 'store')}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=collective_timeout_s))
        result = ("ok", fn(rank, world, *args))
    except BaseException:
        result = ("error", traceback.format_exc())
    with open(os.path.join(root, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def _context(start: str):
    ctx = mp.get_context(start)
    if start == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the session's first forkserver rank
    return ctx


def run_ranks(fn, world: int, tmp_path, *args, timeout_s: float = 180.0,
              collective_timeout_s: float = COLLECTIVE_TIMEOUT_S, start: str = "forkserver") -> list:
    root = str(tmp_path / f"ranks-{world}-{time.monotonic_ns()}")
    os.makedirs(root)
    ctx = _context(start)
    environ = dict(os.environ)
    procs = [ctx.Process(target=_child, args=(r, world, root, fn, args, collective_timeout_s, environ), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join(10)
    results, errors = [], []
    for r in range(world):
        path = os.path.join(root, f"rank{r}.pkl")
        if not os.path.exists(path):
            errors.append(f"rank {r}: no result (exit code {procs[r].exitcode}{', killed after timeout' if r in hung else ''})")
            results.append(None)
            continue
        with open(path, "rb") as f:
            status, value = pickle.load(f)
        if status == "error":
            errors.append(f"rank {r} raised:\n{value}")
        results.append(value)
    assert not errors, "\n".join(errors)
    return results
