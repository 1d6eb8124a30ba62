"""Spill directories: one per engine, named after its owner, reclaimed once the owner is gone.

An engine's spill files live in ``<spill_dir>/megatrain-spill-<host>-pid<pid>-<random>/``
next to ``owner.json`` (host, pid, and the process's start time, so a reused pid
is not taken for the owner). ``close()`` removes the directory; a killed process
cannot, so the next engine that opens a spill directory in the same spill_dir
first removes those whose ``owner.json`` names a process of this host that is no
longer running, and warns with what it removed and the space it freed. A directory
of another host, of a running process, not named this way, or without that record
(megatrain did not make it, or cannot tell) is never touched; one named like ours
with a dead pid but no record is said once, in one line.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import warnings

from megatrain.runtime.spill.spill_io import SpillError

PREFIX = "megatrain-spill-"
OWNER_FILE = "owner.json"
_NAME = re.compile(r"megatrain-spill-(?P<host>[A-Za-z0-9._]+)-pid(?P<pid>\d+)-[A-Za-z0-9_]+")
# The folders this process has said it leaves (each said once, however many engines open the spill_dir).
_REPORTED: set[str] = set()


def host_name() -> str:
    """This machine's name as it appears in spill directory names (``-`` and odd characters become ``_``)."""
    return re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "localhost"


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux ``/proc``), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[19])  # field 22 of stat; fields[0] is field 3 (the state)
    except (OSError, IndexError, ValueError):
        return None


def owner_running(pid: int, start: int | None) -> bool:
    """Whether process ``pid`` (started at ``start``, when known) still runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    if start is not None:
        now = process_start(pid)
        if now is not None and now != start:
            return False  # the pid was reused by a later process
    return True


def reclaim(spill_dir: str) -> list[str]:
    """Remove the spill directories in ``spill_dir`` whose ownership record names a process of this host that no
    longer runs; their paths. One named like ours without such a record is left, and said once (one line)."""
    try:
        entries = sorted(os.listdir(spill_dir))
    except OSError:
        return []
    host, removed, left, freed = host_name(), [], [], 0
    for entry in entries:
        m = _NAME.fullmatch(entry)
        path = os.path.join(spill_dir, entry)
        if m is None or m["host"] != host or not os.path.isdir(path) or os.path.islink(path):
            continue
        owner = _owner(path)
        if owner is None or owner.get("pid") != int(m["pid"]) or owner.get("host") not in (socket.gethostname(), host):
            if not owner_running(int(m["pid"]), None) and path not in _REPORTED:
                left.append(path)  # not megatrain's record of a process here: not ours to delete
            continue
        start = owner.get("start")
        if owner_running(int(m["pid"]), start if isinstance(start, int) else None):
            continue
        freed += _disk_bytes(path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        warnings.warn(f"removed {len(removed)} spill director{'y' if len(removed) == 1 else 'ies'} left in {spill_dir} "
                      f"by runs that are no longer running ({freed / 2**30:.2f} GiB): "
                      f"{', '.join(os.path.basename(p) for p in removed)}", UserWarning, stacklevel=2)
    if left:
        _REPORTED.update(left)
        warnings.warn(f"left {len(left)} folder(s) in {spill_dir} named like spill directories but without "
                      f"megatrain's {OWNER_FILE}: {', '.join(os.path.basename(p) for p in left)}; delete them "
                      f"yourself if they are not needed", UserWarning, stacklevel=2)
    return removed


def _owner(path: str) -> dict | None:
    """The ownership record ``create`` wrote in ``path``, or None (missing, unreadable, not ours)."""
    try:
        with open(os.path.join(path, OWNER_FILE), encoding="utf-8") as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) and isinstance(owner.get("pid"), int) else None


def create(spill_dir: str) -> str:
    """A new spill directory for this process in ``spill_dir`` (after reclaiming dead owners' ones)."""
    if not os.path.isdir(spill_dir):
        raise SpillError(f"spill_dir {spill_dir} is not a directory; create it (on a fast local disk) or fix the path")
    reclaim(spill_dir)
    pid = os.getpid()
    try:
        root = tempfile.mkdtemp(prefix=f"{PREFIX}{host_name()}-pid{pid}-", dir=spill_dir)
    except OSError as e:
        raise SpillError(f"cannot write in spill_dir {spill_dir}: {e.strerror}; choose a writable directory") from None
    try:
        with open(os.path.join(root, OWNER_FILE), "w", encoding="utf-8") as f:
            json.dump({"host": socket.gethostname(), "pid": pid, "start": process_start(pid)}, f)
    except OSError as e:
        shutil.rmtree(root, ignore_errors=True)
        raise SpillError(f"cannot write in spill_dir {spill_dir}: {e.strerror}; choose a writable directory") from None
    return root


def _disk_bytes(path: str) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(root, n)).st_blocks * 512
            except OSError:
                pass
    return total
