"""Who watches the routers: where a training step's routing statistics and the load-balancing loss's gradient
enter a sparse MLP (architecture only; what is counted and how is the runtime's).

The runtime installs an observer around a layer's computation (``observing``); each ``Router`` hands it its
logits [T, E] before routing (the observer may return them with a gradient attached) and the experts it chose
[T, k] after. Without an observer a router computes alone. The observer is a context variable, so the stateless
block templates stay shared by every layer and nothing is attached to a module or a parameter.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Iterator, Protocol

import torch


class RouterObserver(Protocol):
    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """A router's logits [T, E] (gpt-oss's with its bias) before it routes; returns what the router routes
        with (the same values)."""

    def routed(self, experts: torch.Tensor) -> None:
        """The experts [T, k] (int64) the router chose for its tokens."""


_OBSERVER: ContextVar[RouterObserver | None] = ContextVar("router_observer", default=None)


@contextlib.contextmanager
def observing(observer: RouterObserver | None) -> Iterator[None]:
    """Every router run inside reports to ``observer`` (None: to nobody)."""
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


def current() -> RouterObserver | None:
    """The observer the routers report to now, if any."""
    return _OBSERVER.get()
