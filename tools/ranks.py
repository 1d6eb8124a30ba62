"""``megatrain-train`` under torchrun: which rank does what, and every rank stopping on one rank's error.

With one process everything here is a pass-through. With W ranks (torchrun sets the environment;
``runtime/distributed/process_group.py`` joins the group, gloo on CPUs, NCCL on GPUs, collectives with a timeout):

- every rank reads and checks every input the same way (``agree``): the options, the model, the
  tokenizer, the data, the plan; if any rank finds an error, every rank stops with that rank's one
  line (exit status 2), before anything is written;
- rank 0 alone takes the run directory (lock, ``--overwrite``), writes metrics, the plot, the summary,
  progress and TensorBoard events (``writes``); every rank builds its engine (its shards of the state),
  reads the same global batches and passes its rows (``rows``) to the step; checkpoints are written by
  all ranks together (runtime/io/sharded_checkpoint.py);
- once rank 0 has taken --out, every rank reads the lock file it wrote there (``see_the_same``): a rank that
  sees another directory (a per-node --out) stops every rank, one line;
- a rank that fails during training prints its own line and exits; the others' next collective then
  fails (the peer's connection closed, or the group's timeout: --collective-timeout, else 300 s while the
  inputs are checked and the plan's bound from then on, ``set_timeout``) and they stop with a line that says so.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch
import torch.distributed as dist

from megatrain.errors import MegatrainError
from megatrain.runtime.distributed import collectives
from megatrain.runtime.distributed.process_group import DEFAULT_TIMEOUT_S, Topology, join, leave, rank_device

from . import train_config, train_options

T = TypeVar("T")
_timeout_s = [DEFAULT_TIMEOUT_S]  # the wait every collective of this process is bounded by now (peer_stopped says it)


class RankError(MegatrainError):
    """Another rank of the run stopped it: its one-line message."""


class Ranks:
    def __init__(self, topology: Topology | None) -> None:
        self.topology = topology

    @classmethod
    def join(cls, timeout_s: float = DEFAULT_TIMEOUT_S) -> "Ranks":
        """This process's rank; every collective of the run waits at most ``timeout_s`` for the others."""
        _timeout_s[0] = timeout_s
        return cls(join(timeout_s))

    def set_timeout(self, seconds: float | None) -> None:
        """Every later collective waits at most ``seconds`` for the other ranks (--collective-timeout, else the
        planner's bound for the run's plan: planner/costs/data_parallel.py, [Note: collective timeout]); None: as now."""
        if self.topology is not None and seconds and collectives.set_timeout(seconds):
            _timeout_s[0] = seconds

    @property
    def world_size(self) -> int:
        return 1 if self.topology is None else self.topology.world_size

    @property
    def rank(self) -> int:
        return 0 if self.topology is None else self.topology.rank

    @property
    def writes(self) -> bool:
        """Whether this rank writes the run's files (metrics, plot, summary, progress): rank 0, or one process."""
        return self.rank == 0

    def rows(self, batch: int) -> slice:
        """This rank's rows of a global batch of ``batch`` rows."""
        if batch % self.world_size:
            raise RankError(f"--batch {batch} does not divide among {self.world_size} ranks; pass a multiple of "
                            f"{self.world_size}")
        share = batch // self.world_size
        return slice(self.rank * share, (self.rank + 1) * share)

    def device(self, device: torch.device) -> torch.device:
        """The rank's device: cuda:LOCAL_RANK for a CUDA run (unverified on GPUs so far), else ``device``."""
        if self.topology is None or device.type != "cuda":
            return device
        chosen = rank_device(self.topology, None)
        return device if chosen is None else chosen

    def agree(self, work: Callable[[], T], errors: tuple[type[BaseException], ...], only_first: bool = False) -> T:
        """Run ``work`` (on rank 0 alone with ``only_first``); if it raises one of ``errors`` on any rank, raise that
        rank's error (its one line) on every rank. One collective: no rank goes on while another has stopped."""
        if self.topology is None:
            return work()
        result: Any = None
        failure: str | None = None
        try:
            if self.writes or not only_first:
                result = work()
        except errors as e:
            failure = _one_line(e)
        everyone: list = [None] * self.world_size
        try:
            dist.all_gather_object(everyone, failure)
        except RuntimeError as e:  # a rank that stopped before agreeing (it printed why)
            raise RankError(peer_stopped(e)) from None
        failed = [(r, f) for r, f in enumerate(everyone) if f is not None]
        if failed:
            rank, line = failed[0]
            raise RankError(line if self.world_size == 1 or rank == self.rank else f"rank {rank}: {line}")
        return result

    def same(self, parts: Mapping[str, Any]) -> None:
        """Every rank holds the same ``parts`` (named JSON values: the plan, the data order, ...), else every rank
        stops with one line naming the first part that differs. One collective."""
        if self.topology is None:
            return
        digests = {name: hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()
                   for name, value in parts.items()}
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, digests)
        for rank, theirs in enumerate(everyone):
            differs = [name for name in parts if theirs.get(name) != everyone[0].get(name)]
            if differs:
                verb = "differ" if differs[0] == "options" else "differs"
                raise RankError(f"rank {rank}'s {differs[0]} {verb} from rank 0's; every rank must run the same "
                                f"command on the same files (check that each node sees the same --data, --plan and "
                                f"--out)")

    def take_run_directory(self, take: Callable[[], None], lock_path: str,
                           errors: tuple[type[BaseException], ...]) -> None:
        """Rank 0 runs ``take`` (it takes --out and writes its lock file, ``lock_path``), as ``agree`` with
        ``only_first``; then every rank reads that file (``see_the_same``): one --out that every node sees."""
        self.agree(take, errors, only_first=True)
        self.see_the_same(lock_path, f"run directory {os.path.dirname(lock_path)}")

    def see_the_same(self, path: str, what: str) -> None:
        """Every rank reads the same bytes at ``path`` (a file rank 0 just wrote: the run's lock in --out), else
        every rank stops with one line: a rank on another node sees another directory (a per-node --out, or a
        path that is local to each node), which checkpoints cannot be written to. One collective."""
        if self.topology is None:
            return
        try:
            with open(path, "rb") as f:
                mine: bytes | None = f.read()
        except OSError:
            mine = None
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        differs = [rank for rank, theirs in enumerate(everyone) if theirs != everyone[0]]
        if differs:
            raise RankError(f"out: rank {differs[0]} does not see the {what} rank 0 made (a per-node --out, or a "
                            f"path local to each node); per-node output directories are not supported: give every "
                            f"node the same --out on storage they all see (a shared filesystem)")

    def leave(self) -> None:
        """Done with the other ranks (their engines closed, their steps over): what this rank does next (rank 0's
        export of the run) runs as one process, and the others may exit meanwhile."""
        if self.topology is not None:
            leave()

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (one all-reduce of a CPU tensor under torchrun)."""
        return self.any_each(flag)[0]

    def any_each(self, *flags: bool) -> tuple[bool, ...]:
        """Whether each of ``flags`` is set on any rank: one all-reduce for all of them under torchrun."""
        if self.topology is None:
            return tuple(flags)
        value = torch.tensor([int(f) for f in flags], dtype=torch.int64)
        if self.topology.backend == "nccl":  # unverified on GPUs so far
            value = value.cuda()
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return tuple(bool(v) for v in value.tolist())

    def say(self, line: str) -> None:
        """A line on stderr, from rank 0 only."""
        if self.writes:
            print(line, file=sys.stderr)


def collective_timeout(argv: Sequence[str] | None) -> float:
    """--collective-timeout (command line or TOML), read before the ranks join; the options are checked in full
    afterwards, on every rank (a bad value is reported then)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(train_options.read_values(args).get("collective_timeout", 0.0))
    except (train_config.TrainConfigError, ValueError, TypeError):
        return DEFAULT_TIMEOUT_S
    return seconds if seconds > 0 else DEFAULT_TIMEOUT_S


def peer_failure(e: RuntimeError) -> bool:
    """Whether ``e`` is a collective failing because another rank stopped (connection closed) or stopped answering
    (timeout), in a run of several ranks."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    text = str(e).lower()
    return isinstance(e, dist.DistError) or any(w in text for w in ("gloo", "nccl", "connection", "timed out"))


def peer_stopped(e: BaseException) -> str:
    """The line a rank prints when another rank stopped the run (that rank printed why), or when a collective
    waited its whole timeout for a rank that stopped answering (hung, or too slow)."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", _one_line(e))  # gloo's [file.cc:line] prefix
    if "timed out" in text.lower() or "timeout" in text.lower():
        return (f"a collective waited {_timeout_s[0]:g} s for another rank, which stopped answering (hung, or "
                f"slower than that; {text[:100]}); megatrain-train stops every rank (--collective-timeout S sets "
                "the wait)")
    return (f"another rank of this run stopped, or stopped answering ({_one_line(e)[:160]}); its own line says why; "
            "megatrain-train stops every rank")


class NullLog:
    """The metrics log of a rank that writes none."""

    def write(self, record: Mapping[str, Any]) -> None:
        pass

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
