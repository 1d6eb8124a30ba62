"""The run directory (``--out``): who owns it, whether a new run may write into it, and where a resumed run goes.

A run directory holds what one run wrote (``RUN_FILES``). The rules, checked before anything is written:

- A fresh run refuses a directory that is not empty, offering ``--resume DIR`` or ``--overwrite``
  (the convention of Hugging Face's ``overwrite_output_dir``). ``--overwrite`` deletes only the
  earlier run's own files (``RUN_FILES``); anything else in the directory stays, and a run that reads
  anything inside those files is refused before they are deleted (tools/run_inputs.py).
- A resumed run writes into the run it resumes (derived from the ``--resume`` path, never from a
  path stored in the checkpoint), or into ``--out`` when that is given.
- The run that writes a directory holds ``megatrain.lock`` in it: an advisory ``flock`` plus the
  owner's pid and host in the file. A second run is refused with one line naming the owner; a lock
  left by a process that died (its ``flock`` released with it) is taken over, and that is said.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import time
from typing import Callable

from .train_config import TrainConfigError, log_targets

CHECKPOINT_DIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"
# A checkpoint's directory name under CHECKPOINT_DIR (the runtime's layout: step-00000025).
STEP_DIR = re.compile(r"step-(\d+)")
LOCK_FILE = "megatrain.lock"
SPILL_DIR = "spill"
# What a run writes in its directory; --overwrite deletes these and nothing else. (Spill files under
# SPILL_DIR are the runtime's: each run's in its own subdirectory, reclaimed by the runtime.)
RUN_FILES = ("metrics.jsonl", "metrics.jsonl.tmp", "summary.json", "summary.json.tmp", "training.png",
             "trace.json", "tensorboard", "wandb", "run.json", "run.json.tmp", CHECKPOINT_DIR)


def check_writable_dir(option: str, path: str) -> None:
    """``path`` is a directory, or can be made one: no file in the way, its nearest existing parent writable.

    Writes nothing; creating the directory later can still fail (e.g. under /proc), and says so in one line.
    """
    if os.path.exists(path) and not os.path.isdir(path):
        raise TrainConfigError(f"{option}: {path} is a file, not a directory; name a directory")
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise TrainConfigError(f"{option}: {path} cannot be created because {parent} is a file; name a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or _no_storage(parent):
        raise TrainConfigError(f"{option}: cannot create {path} ({parent} is not writable); choose a writable "
                               f"directory")


def _no_storage(path: str) -> bool:
    """A read-only filesystem, or one with no blocks at all (/proc, /sys): nothing can be written there."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return bool(st.f_flag & os.ST_RDONLY) or st.f_blocks == 0


def make_dir(option: str, path: str) -> bool:
    """Create ``path`` (and its parents); True when it did not exist. One line on failure."""
    existed = os.path.isdir(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise TrainConfigError(f"{option}: cannot create {path} ({e.strerror}); choose a writable directory") from None
    return not existed


def run_of_checkpoint(path: str) -> str | None:
    """The run directory a --resume path belongs to: the run itself, its ``checkpoints/``, or one ``step-N`` in it.

    None when ``path`` is a checkpoint outside a run directory (then --out must say where to write).
    """
    path = os.path.normpath(os.path.abspath(path))
    if os.path.isdir(os.path.join(path, CHECKPOINT_DIR)):
        return path
    if os.path.basename(path) == CHECKPOINT_DIR:
        return os.path.dirname(path)
    parent = os.path.dirname(path)
    if os.path.basename(parent) == CHECKPOINT_DIR:
        return os.path.dirname(parent)
    return None


def existing_entries(path: str) -> list[str]:
    """The names in ``path`` (sorted), or [] when it does not exist."""
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def refuse_existing(path: str, resumable: bool) -> None:
    """A fresh run into a directory that already holds something: one line with the two ways forward."""
    entries = [e for e in existing_entries(path) if e != LOCK_FILE]  # a lock alone: a run that died at start
    if not entries:
        return
    what = "an earlier run" if resumable else f"{len(entries)} file(s) ({', '.join(entries[:3])})"
    offer = f"--resume {path} to continue it, " if resumable else ""
    raise TrainConfigError(f"out: {path} already holds {what}; pass {offer}--overwrite to replace the run's files, "
                           f"or a new --out directory")


def remove_run_files(path: str) -> list[str]:
    """--overwrite: delete the earlier run's own files (``RUN_FILES``) in ``path``; the names deleted."""
    removed = []
    for name in RUN_FILES:
        full = os.path.join(path, name)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full)
        elif os.path.lexists(full):
            os.remove(full)
        else:
            continue
        removed.append(name)
    return removed


def owner_if_running(directory: str) -> str | None:
    """The live owner of ``directory``'s lock (pid, host), or None: probes without creating or changing anything."""
    try:
        fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return _describe(_read_owner(fd))
    finally:
        os.close(fd)  # closing drops a lock taken by the probe
    return None


def refuse_if_running(directory: str) -> None:
    owner = owner_if_running(directory)
    if owner is not None:
        raise TrainConfigError(f"out: {directory} is in use by another run ({owner}); wait for it to finish or "
                               f"choose another --out")


class RunLock:
    """The advisory lock of one run directory, held from ``acquire`` to ``release`` (see the module docstring)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self, say: Callable[[str], None]) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise TrainConfigError(f"out: cannot create {self.path} ({e.strerror}); choose a writable --out") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            refuse_if_running(os.path.dirname(self.path))
            raise TrainConfigError(f"out: {os.path.dirname(self.path)} is in use by another run; wait for it to "
                                   f"finish or choose another --out") from None
        previous = _read_owner(fd)
        if previous:
            say(f"taking over the lock of a run that is no longer running ({_describe(previous)})")
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        os.fsync(fd)  # on the file server before the other nodes read it (Ranks.see_the_same: one shared --out)
        self._fd = fd

    def release(self) -> None:
        """Delete the lock file, then let go of the lock (a waiting run then finds no owner)."""
        if self._fd is None:
            return
        try:
            os.remove(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def _read_owner(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode("utf-8", errors="replace") or "{}")
    except (OSError, ValueError):
        return {"pid": "?", "host": "?"}
    return data if isinstance(data, dict) else {"pid": "?", "host": "?"}


def _describe(owner: dict) -> str:
    return f"pid {owner.get('pid', '?')} on {owner.get('host', '?')}" + \
        (f", started {owner['started']}" if owner.get("started") else "")


def written(out: str, log_to: str) -> dict[str, str]:
    """The summary's paths of the files and folders a run writes in ``out`` besides its metrics, checkpoints, plot
    and trace: summary.json, run.json (the options, when the run took the directory), tensorboard/ and wandb/
    (``--log-to``)."""
    found = {"summary": os.path.join(out, "summary.json")}
    if os.path.exists(os.path.join(out, "run.json")):
        found["run_record"] = os.path.join(out, "run.json")
    for target in ("tensorboard", "wandb"):
        if target in log_targets(log_to):
            found[target] = os.path.join(out, target) + os.sep
    return {k: os.path.abspath(v) + (os.sep if v.endswith(os.sep) else "") for k, v in found.items()}
