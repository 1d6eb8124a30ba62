"""Paths the user hands the API, checked where they enter: a str or os.PathLike, non-empty, no NUL byte."""
from __future__ import annotations

import os
from typing import Any

from megatrain.runtime.errors import ConfigError


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
