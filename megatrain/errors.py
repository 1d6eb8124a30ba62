"""The one exception family every part of megatrain raises for input a user can fix.

Standard library only: the planner and the runtime both import it (the planner
never imports the runtime). ``megatrain.runtime`` re-exports it unchanged.
"""
from __future__ import annotations


class MegatrainError(ValueError):
    """Base class: something the user can fix, explained in one line (what is wrong, and how to fix it)."""


__all__ = ["MegatrainError"]
