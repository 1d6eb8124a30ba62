"""Device fp32 gradient accumulators and their drain to the host.

A block's gradients accumulate over its micro-batches in one fp32 device
buffer (zeroed on acquire, or written first by ``BlockGrads``: a decoder
layer's, an untied embedding's), then drain to host memory on the d2h stream. The
buffer is reused only after the drain: the compute stream waits on the
``drained`` event before writing it again. Bound: ``count`` buffers of the
largest block's gradient (``grad_unit``: count x that x 4 bytes on the device);
a tied embedding's gradient has a buffer of its own instead, kept from the head
(forward) to the embedding (end of backward), so ``grad_unit`` leaves it out (for
a tied Llama-3.2-3B shape a layer's 100.7M elements, not the table's 394.0M). In
place ([Note: compute in place], weight_slots.py) the buffers hold nothing: a
block's gradients add up in its host gradients (``host_grads``), which its drain
then leaves as they are. A resident block's gradients ([Note: resident blocks]) add up in its own device buffer
the same way, and ``grad_unit`` leaves those blocks out.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from megatrain.runtime.model.templates import Block, BlockLayout, Templates
from megatrain.runtime.pipeline.experts.expert_parts import Part
from megatrain.runtime.pipeline.step_timer import StepTimer
from megatrain.runtime.device.streams import Event, Streams


def grad_unit(templates: Templates, parts: Mapping[int, Sequence[Part]], numel: Callable[[Block], int],
              tied: bool, resident: frozenset[int] = frozenset()) -> int:
    """Elements of one gradient buffer: the largest block's gradient (``numel``: padded to whole shards in data
    parallel) or streamed part's, leaving out a ``tied`` embedding's, which adds up in a buffer of its own: the
    planner's Bg (planner/costs/stream_units.py, ``grad_numel``); the ``resident`` blocks' add up in their own buffers."""
    return max((max(p.numel for p in parts[b.index]) if b.index in parts else numel(b)
                for b in templates.blocks if not (tied and b.index == templates.embed.index) and b.index not in resident),
               default=0)


class GradBuffers:
    def __init__(self, count: int, numel: int, device: torch.device, streams: Streams, timer: StepTimer,
                 host_grads: Callable[[int], torch.Tensor] | None = None,
                 own_grads: Callable[[int], torch.Tensor | None] = lambda b: None) -> None:
        """``host_grads``: in place, block b's host gradients (``numel`` is then 0); ``own_grads``: block b's own
        buffer where it has one (a resident block's), else None."""
        self.host_grads, self.own_grads = host_grads, own_grads
        self.buffers = [torch.zeros(numel, dtype=torch.float32, device=device) for _ in range(count)]
        self.drained: list[Event] = [streams.event() for _ in range(count)]
        self.streams = streams
        self.timer = timer
        self._next = 0

    def acquire(self, numel: int, block: int | None = None, zeroed: bool = True) -> tuple[int, torch.Tensor]:
        """A zeroed fp32 buffer [numel] for block ``block`` on the compute stream, its previous drain complete
        (in place: the block's host gradients; a resident block: its own); ``zeroed=False``: as it is, for a
        ``BlockGrads`` to write."""
        index = self._next
        self._next = (self._next + 1) % len(self.buffers)
        with self.timer.stall("d2h", self.streams.compute):
            self.streams.compute.wait_event(self.drained[index])
        own = None if block is None else self.own_grads(block)
        if own is not None:
            buf = own
        elif self.host_grads is not None:
            assert block is not None, "refused by Plan: compute_in_place with expert groups"
            buf = self.host_grads(block)
        else:
            buf = self.buffers[index][:numel]
        if zeroed:
            buf.zero_()
        return index, buf

    def drain(self, index: int | None, buf: torch.Tensor, host: torch.Tensor, after: Event | None = None) -> Event:
        """Copy ``buf`` (device fp32) into ``host`` (pinned fp32) after the compute that wrote it (or after
        ``after``, when another stream wrote it after that compute: a reduce-scatter).

        Returns the event a host thread synchronizes on before reading ``host``.
        """
        ready = self.streams.recorded(self.streams.compute) if after is None else after
        if buf.data_ptr() == host.data_ptr():  # in place: the gradients are where they drain to
            return ready
        with self.streams.d2h.use():
            self.streams.d2h.wait_event(ready)
            with self.timer.copy("d2h", self.streams.d2h):
                host.copy_(buf, non_blocking=True)
            done = self.streams.recorded(self.streams.d2h)
        if index is not None:
            self.drained[index] = done
        return done


class BlockGrads:
    """A block's gradients (a decoder layer's, an embedding's) handed over into its buffer, one step: a buffer
    acquired with ``zeroed=False``, or (``holding``) one that holds gradients of this step already.

    A parameter's first gradient of the step is copied into its view; later ones (more micro-batches, more
    sequence tiles) are added to it. ``close`` zeroes what no gradient reached: the parameters without one, the
    alignment gaps between the views and the buffer's tail (data-parallel padding). The buffer then holds what
    zeroing it first and adding every gradient would, number for number (a copied -0.0 stays -0.0 where
    0.0 + -0.0 gives 0.0): zeroing and adding cost one more pass over the layer's gradients than copying, and the
    extra read of the buffer.
    """

    def __init__(self, layout: BlockLayout, buf: torch.Tensor, holding: bool = False) -> None:
        """``holding``: ``buf`` holds this step's gradients already (a tied embedding's, lm_head's): every
        gradient is added to it."""
        entries = layout.entries
        self._views = layout.view_list(buf)
        self._index = {e.local_name: i for i, e in enumerate(entries)}
        self._written = [holding] * len(entries)
        starts = [e.offset for e in entries] + [buf.numel()]
        ends = [0] + [e.offset + e.numel for e in entries]
        self._gaps = [buf[a:b] for a, b in zip(ends, starts) if b > a]

    def add(self, by_name: dict[str, torch.Tensor]) -> None:
        """Gradients by local name into their views: copied where first, else added."""
        first: tuple[list, list] = ([], [])
        more: tuple[list, list] = ([], [])
        for name, g in by_name.items():
            i = self._index[name]
            pair = more if self._written[i] else first
            pair[0].append(self._views[i])
            pair[1].append(g)
            self._written[i] = True
        if first[0]:
            torch._foreach_copy_(*first)
        if more[0]:
            torch._foreach_add_(*more)

    def close(self) -> None:
        """Zero the views no gradient reached and the gaps: the buffer is the sum, ready to drain."""
        rest = [v for v, w in zip(self._views, self._written) if not w] + self._gaps
        if rest:
            torch._foreach_zero_(rest)


class TiedGrad:
    """A tied embedding's gradient: lm_head's lands in it in forward (the head), the embedding's in backward; one
    fp32 buffer of the embedding's size ([numel]) for the whole step, its own on the device, or ``own`` (in place:
    the embedding's host gradients; resident: its device buffer). Memory: the planner's "tied embedding grad"."""

    def __init__(self, embed: Block, numel: int, device: torch.device, own: torch.Tensor | None, streams: Streams,
                 timer: StepTimer) -> None:
        self.embed, self.streams, self.timer = embed, streams, timer
        self.buffer = own if own is not None else torch.zeros(numel, dtype=torch.float32, device=device)

    def for_head(self, drained: Event) -> torch.Tensor:
        """Where the head adds lm_head's gradient ([vocab, hidden] fp32): the buffer, zeroed once its previous
        step's drain (``drained``) is done."""
        with self.timer.stall("d2h", self.streams.compute):
            self.streams.compute.wait_event(drained)
        self.buffer.zero_()
        return self.embed.layout.views(self.buffer)["embed_tokens.weight"]
