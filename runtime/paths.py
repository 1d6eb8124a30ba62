"""Paths the user hands the API, checked where they enter: a str or os.PathLike, non-empty, no NUL byte; and paths
read from a file (a shard index's ``weight_map``, a checkpoint manifest), confined to the file's directory."""
from __future__ import annotations

import os
from typing import Any

from megatrain.runtime.errors import ConfigError, InputError


def user_path(value: Any, what: str) -> str:
    """``value`` as a str path, or one line naming ``what`` (e.g. ``"directory"``) and what it must be."""
    try:
        path = os.fspath(value)
    except TypeError:
        raise ConfigError(f"{what}={value!r} must be a path (str or os.PathLike)") from None
    if isinstance(path, bytes):
        try:
            path = os.fsdecode(path)
        except UnicodeDecodeError:
            raise ConfigError(f"{what}={value!r} is not a valid path; pass a str") from None
    if not path or "\0" in path:
        raise ConfigError(f"{what}={value!r} must be a non-empty path without NUL characters")
    return path


def confined(directory: str, name: Any, source: str) -> str:
    """``directory/name`` for a ``name`` read from the file ``source``, which must stay inside ``directory``.

    Refused in one line naming the entry: anything but a relative path (an absolute one, an empty one), a ``..``
    that climbs out, or a symlink whose target lies outside. The one symlink out allowed is a Hugging Face cache
    snapshot's (``models--org--name/snapshots/<commit>/x`` -> ``../../blobs/<hash>``): inside the repository's own
    cache folder. Models downloaded from a hub and checkpoints copied between machines are untrusted input.
    """
    if not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name):
        raise InputError(f"{source} names {name!r}, which is not a relative path inside {directory}; the file is "
                         f"corrupt or not to be trusted: re-download or re-export it")
    full = os.path.join(directory, name)
    root, real = os.path.realpath(directory), os.path.realpath(full)
    repo = os.path.dirname(os.path.dirname(root))  # a cache snapshot's repository folder (blobs/, snapshots/)
    cached = os.path.basename(os.path.dirname(root)) == "snapshots" and os.path.basename(repo).startswith("models--")
    if not _within(os.path.normpath(full), os.path.normpath(directory)) or not (
            _within(real, root) or (cached and _within(real, os.path.join(repo, "blobs")))):
        raise InputError(f"{source} names {name!r}, which leads outside {directory}; the file is corrupt or not to "
                         f"be trusted: re-download or re-export it")
    return full


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)
