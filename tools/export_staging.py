"""The folders an export writes into before the result is renamed into place, and the ones a killed export left.

``megatrain-export RUN OUT`` writes OUT's files into ``.OUT.export-<random>/`` beside OUT (and a spilling
checkpoint's scratch files into ``.megatrain-export-spill-<random>/``), then renames the complete folder to OUT.
Each such folder holds ``OWNER_FILE`` (host, pid, the process's start time) while it is being written; the record
is taken out just before the rename. A failed export removes its folders on the way out; a killed one cannot, so
the next export into the same parent removes those whose record names a process of this host that is no longer
running. A folder without the record (megatrain did not make it, or cannot tell) is never touched.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile

from megatrain.runtime.spill.spill_dirs import owner_running, process_start

OWNER_FILE = ".megatrain-export-owner.json"
SPILL_PREFIX = ".megatrain-export-spill-"
# The names tempfile.mkdtemp gives the two kinds of folder (``staging_prefix``, ``SPILL_PREFIX``).
_NAMES = re.compile(r"\..+\.export-[A-Za-z0-9_]+|" + re.escape(SPILL_PREFIX) + r"[A-Za-z0-9_]+")


def staging_prefix(out: str) -> str:
    return f".{os.path.basename(os.path.abspath(out))}.export-"


def create(parent: str, prefix: str) -> str:
    """A new folder ``parent/<prefix><random>`` holding this process's ownership record, with the mode the
    user's umask gives a new directory (``mkdtemp`` alone makes it 0700)."""
    folder = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        with open(os.path.join(folder, OWNER_FILE), "w", encoding="utf-8") as f:
            json.dump({"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid())}, f)
        os.chmod(folder, 0o777 & ~_umask())
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def finish(folder: str) -> None:
    """The export in ``folder`` is complete: its ownership record goes, before the rename into place."""
    os.remove(os.path.join(folder, OWNER_FILE))


def reclaim(parent: str) -> list[str]:
    """Remove the staging and scratch folders in ``parent`` left by exports of this host that no longer run;
    their names."""
    try:
        entries = sorted(os.listdir(parent))
    except OSError:
        return []
    removed = []
    for name in entries:
        path = os.path.join(parent, name)
        if not _NAMES.fullmatch(name) or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, OWNER_FILE), encoding="utf-8") as f:
                owner = json.load(f)
        except (OSError, ValueError):
            continue  # no record of ours: not ours to delete
        if not isinstance(owner, dict) or owner.get("host") != socket.gethostname() \
                or not isinstance(owner.get("pid"), int):
            continue
        start = owner.get("start")
        if owner_running(owner["pid"], start if isinstance(start, int) else None):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    return removed


def _umask() -> int:
    """The process's umask (read by setting it and putting it back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
