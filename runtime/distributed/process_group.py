"""Where this process stands among the ranks of a data-parallel run: the topology and its initialisation.

A run with several ranks is one process per device under ``torchrun`` (or any launcher that
initialises ``torch.distributed``). ``join()`` answers, once per engine:

- a process group already initialised with more than one rank: this process is one of its ranks;
- none, but torchrun's environment (``WORLD_SIZE`` > 1, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT``): the group is initialised here, NCCL with CUDA and gloo without, every collective
  with ``timeout_s`` (a rank that stops answering fails the others instead of hanging them);
- otherwise (or one rank, or once this process has left its group with ``leave``): ``None``, and the engine
  runs as one process, exactly as without this module.

With CUDA each rank's device is ``cuda:LOCAL_RANK`` unless the caller names one.
"""
from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from megatrain.runtime.errors import ConfigError

_left: list[bool] = []  # non-empty once this process left its group (``leave``): one process from then on
_made: list[bool] = []  # non-empty once ``join`` initialised the group itself (torchrun's environment)
DEFAULT_TIMEOUT_S = 300.0  # a collective that waits longer fails (gloo: raises; NCCL: the watchdog aborts)


@dataclass(frozen=True)
class Topology:
    rank: int  # this process's rank, 0 .. world_size - 1
    world_size: int
    local_rank: int  # rank among the processes of this node (its device index with CUDA)
    local_world_size: int  # ranks on this node
    backend: str  # "nccl" or "gloo"

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


def join(timeout_s: float = DEFAULT_TIMEOUT_S) -> Topology | None:
    """This process's place among the ranks (initialising the group from torchrun's environment if needed);
    None for a single process."""
    if not dist.is_available() or _left:
        return None
    if not dist.is_initialized():
        world = _env_int("WORLD_SIZE", 1)
        if world <= 1:
            return None
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
        try:
            timeout = datetime.timedelta(seconds=timeout_s)
            dist.init_process_group(backend, timeout=timeout, **_attempt_store(world, timeout))
        except (RuntimeError, ValueError) as e:
            raise ConfigError(f"cannot join the {world} ranks of this run ({_first_line(e)}); check MASTER_ADDR, "
                              "MASTER_PORT and that every rank was started (torchrun --nproc-per-node ...)") from None
        _made.append(True)
        atexit.register(leave)  # the group this module made is taken down before the interpreter's teardown
    world = dist.get_world_size()
    if world <= 1:
        return None
    return Topology(rank=dist.get_rank(), world_size=world, local_rank=_env_int("LOCAL_RANK", dist.get_rank()),
                    local_world_size=_env_int("LOCAL_WORLD_SIZE", world), backend=str(dist.get_backend()))


def _attempt_store(world: int, timeout: datetime.timedelta) -> dict:
    """[Note: a restart's own store]
    Under torchrun with the agent's store (``TORCHELASTIC_USE_AGENT_STORE``: the c10d rendezvous, ``--standalone``)
    every attempt's ranks connect to the same TCPStore server, which the agent creates once and keeps across
    ``--max-restarts``, and torch's ``env://`` adds no per-attempt prefix. The keys a process group writes there
    (each rank's gloo address) outlive the attempt that wrote them: a restarted rank could read its dead peer's
    address before the peer's new one replaces it and fail with "Connection refused". So the group's keys go
    under ``megatrain/<run id>/attempt-<restart count>``, fresh for every attempt. Otherwise: torch's ``env://``."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    run, restarts = os.environ.get("TORCHELASTIC_RUN_ID", ""), _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    attempt = f"megatrain/{run}/attempt-{restarts}"
    client = dist.TCPStore(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT", 0), world, is_master=False,
                           timeout=timeout)
    return {"store": dist.PrefixStore(attempt, client), "rank": _env_int("RANK", 0), "world_size": world}


def rank_device(topology: Topology | None, device: torch.device | None) -> torch.device | None:
    """The device a rank computes on: the caller's, else ``cuda:LOCAL_RANK`` with CUDA, else None (auto)."""
    if topology is None or device is not None or not torch.cuda.is_available():
        return device
    return torch.device("cuda", topology.local_rank % torch.cuda.device_count())


def leave() -> None:
    """Destroy the process group (a rank done with collectives: what follows runs as one process). At exit too:
    left to the C++ static destructors, gloo's threads can be torn down while joinable and abort the process
    ("terminate called without an active exception")."""
    _left.append(True)
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End a program with ``code``: as Python ends it, or, in a process whose group ``join`` made, as
    [Note: a rank's exit] says."""
    if not _made:
        sys.exit(code)
    for thread in threading.enumerate():  # what finalization waits for first: a checkpoint still being written
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # then the exit handlers: ``leave``, engines still open, loggers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# [Note: a rank's exit]
# gloo runs collectives on its own worker threads, and a worker drops its reference to a finished collective (and
# to the tensors it used) a moment after the caller's wait returns. When the tensor's last reference owns its Python
# object, dropping it takes the GIL. If the main thread has meanwhile reached the interpreter's finalization, taking
# the GIL ends the worker thread by unwinding it through a C++ destructor, and the process aborts ("terminate called
# without an active exception", after a run that succeeded; seen about once in 30 two-rank runs on a loaded
# machine, from the last collective of a sharded checkpoint). Destroying the group does not wait for its workers.
# So a rank process ends without the finalization: it does what finalization does that matters (joins the
# non-daemon threads, runs the exit handlers, flushes standard output and error) and then ``os._exit``.


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer; it is set by torchrun, leave it to it") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
