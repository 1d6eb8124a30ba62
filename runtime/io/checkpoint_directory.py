"""A checkpoint directory: its ``step-<N>`` directories, the ``latest`` pointer, the moves of the commit
protocol that make a written step visible and remove old ones, and which step a reader loads.

Every move here keeps the invariants of [Note: checkpoint commit protocol] (training_checkpoint.py): a
directory is removed by renaming it to ``*.tmp`` first, ``latest`` is replaced atomically, each change is
fsynced before the next, and a reader takes only complete step directories (with a manifest).
"""
from __future__ import annotations

import os
import re
import shutil

from megatrain.runtime.errors import InputError
from megatrain.runtime.io.checkpoint_format import MANIFEST
from megatrain.runtime.paths import user_path

LATEST = "latest"
RESAVE = ".resave"  # a re-saved step's new copy while it replaces the old one
STEP_DIR = re.compile(r"step-(\d+)(?:\.resave)?")


# ---------------------------------------------------------------------- writing
def clear_leftovers(directory: str) -> None:
    """Before a write: an interrupted re-save finished, then the ``*.tmp`` leftovers of crashed writes removed
    (one writer per directory); afterwards no ``*.tmp`` can be the only copy of a step."""
    finish_interrupted_resaves(directory)
    for name in os.listdir(directory):
        if name.endswith(".tmp") and os.path.isdir(os.path.join(directory, name)):
            shutil.rmtree(os.path.join(directory, name))


def publish(directory: str, tmp: str, final: str) -> None:
    """The complete step directory ``tmp`` (fsynced, manifest last) becomes ``final``, with ``latest`` naming it."""
    name = os.path.basename(final)
    if is_complete(final):  # re-saving a step (e.g. after loading it): the old copy stays until the switch
        os.rename(tmp, final + RESAVE)
        fsync_dir(directory)
        switch_resave(directory, name)
        return
    if os.path.lexists(final):  # an incomplete directory under the final name: never a checkpoint
        remove_step(directory, name)
    # latest first: no complete step directory is ever newer than the one latest names (until the rename,
    # latest names a directory not there yet, and readers take the newest complete one: the previous)
    point_latest(directory, name)
    os.rename(tmp, final)
    fsync_dir(directory)


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def point_latest(directory: str, name: str) -> None:
    """``latest`` names ``name``, atomically and durably."""
    write_durably(os.path.join(directory, LATEST + ".tmp"), name + "\n")
    os.replace(os.path.join(directory, LATEST + ".tmp"), os.path.join(directory, LATEST))
    fsync_dir(directory)


def remove_step(directory: str, name: str) -> None:
    """Remove a step directory: renamed to ``*.tmp`` first, so readers never see it half deleted."""
    doomed = os.path.join(directory, name + ".deleting.tmp")
    os.rename(os.path.join(directory, name), doomed)
    fsync_dir(directory)
    shutil.rmtree(doomed)


def switch_resave(directory: str, name: str) -> None:
    """``name + RESAVE`` (complete, the newer copy of the step) replaces ``name``; at every moment one of the two
    is complete and ``latest`` names it or the other spelling (see [Note: checkpoint commit protocol])."""
    point_latest(directory, name + RESAVE)
    if os.path.lexists(os.path.join(directory, name)):
        remove_step(directory, name)
    os.rename(os.path.join(directory, name + RESAVE), os.path.join(directory, name))
    fsync_dir(directory)
    point_latest(directory, name)


def finish_interrupted_resaves(directory: str) -> None:
    """A crash during a re-save leaves a complete ``step-<N>.resave``: it is the newer copy, so it takes over."""
    for entry in sorted(os.listdir(directory)):
        if entry.endswith(RESAVE) and STEP_DIR.fullmatch(entry):
            if is_complete(os.path.join(directory, entry)):
                switch_resave(directory, entry[:-len(RESAVE)])
            else:
                remove_step(directory, entry)


def prune(directory: str, newest: str, keep: int) -> None:
    """All but the newest ``keep`` complete step directories removed (``newest`` always stays)."""
    complete = [(step, name) for step, name in complete_steps(directory) if name != newest]
    for _, name in complete[:max(0, len(complete) - (keep - 1))]:
        remove_step(directory, name)  # invisible to readers before any file goes


def complete_steps(directory: str) -> list[tuple[int, str]]:
    """(step, name) of the complete step directories, oldest first."""
    return sorted((int(m.group(1)), name) for name in os.listdir(directory)
                  if (m := STEP_DIR.fullmatch(name)) and os.path.isfile(os.path.join(directory, name, MANIFEST)))


def write_durably(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_tree(path: str) -> None:
    for root, _, names in os.walk(path):
        for n in names:
            fsync_file(os.path.join(root, n))


def fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fsync_file(path)


# ---------------------------------------------------------------------- reading
def resolve(directory: str | os.PathLike) -> str:
    """The complete step directory to load: ``directory`` itself, the one ``latest`` names, or the newest complete."""
    directory = user_path(directory, "directory")
    if os.path.isfile(os.path.join(directory, MANIFEST)):
        if directory.rstrip("/").endswith(".tmp"):
            raise InputError(f"{directory} is an unfinished checkpoint (*.tmp); load its parent directory instead")
        return directory
    if not os.path.isdir(directory):
        raise InputError(f"no checkpoint directory at {directory}; pass the directory save_checkpoint wrote")
    latest = os.path.join(directory, LATEST)
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as f:
            name = f.read().strip()
        if STEP_DIR.fullmatch(name):  # mid-switch of a re-save, the other spelling is the complete one
            other = name[:-len(RESAVE)] if name.endswith(RESAVE) else name + RESAVE
            for candidate in (name, other):
                if os.path.isfile(os.path.join(directory, candidate, MANIFEST)):
                    return os.path.join(directory, candidate)
    complete = complete_steps(directory)
    if not complete:
        raise InputError(f"no complete checkpoint in {directory} (a step-<N> directory with {MANIFEST}); "
                         "pass the directory save_checkpoint wrote")
    return os.path.join(directory, complete[-1][1])
