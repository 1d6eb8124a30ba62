"""The one exception family every part of megatrain raises for input a user can fix.

Standard library only: the planner and the runtime both import it (the planner
never imports the runtime). ``megatrain.runtime`` re-exports it unchanged.
"""
from __future__ import annotations


class MegatrainError(ValueError):
    """Base class: something the user can fix, explained in one line (what is wrong, and how to fix it).

    A message names what the user passed (a path, a value), which may itself hold a line break: the message
    keeps it escaped (``\\n``, ``\\r``), so it stays one line whatever went into it."""

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str):
            args = (args[0].replace("\r", "\\r").replace("\n", "\\n"), *args[1:])
        super().__init__(*args)


__all__ = ["MegatrainError"]
