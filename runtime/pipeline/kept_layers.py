"""Kept layers: a decoder layer whose forward keeps its autograd graph for backward, so it is never recomputed.

[Note: kept layers]
``Plan.kept_layers`` names the decoder layers whose activations stay from forward to backward; every other
layer saves its input as a boundary checkpoint and is recomputed from it in backward
(activation_checkpoints.py). A kept layer's forward runs with autograd on, every micro-batch, and its
backward is ``torch.autograd.grad`` through that graph: the same kernels, in the same order, on the same
inputs as a whole-sequence recompute followed by its backward, so the gradients are the same bits (and the
same as plain PyTorch's, which never recomputes; with sequence tiles, the tiled forward's graph, within the
tiles' summation-order bound). The planner keeps layers only where nothing is tiled.

The hazard: autograd saves the tensors a backward formula needs, and for a matmul or a norm one of them is
the weight, here a view of the device slot the block ran from. That slot is refilled with other blocks'
weights long before backward, so a graph holding the views would compute with another layer's weights.
The graph is therefore recorded under ``torch.autograd.graph.saved_tensors_hooks``: a saved tensor whose
storage is the slot's is packed as the block's own identity (the parameter's local name, and the view's
shape, stride and offset within that parameter), never as memory; when backward asks for it, it is
unpacked as the same view of the slot the block is resident in now: backward loads every layer again
anyway (its input gradient needs the weights), so a kept layer costs no slot and no load of its own.
Everything else autograd saves (activations, the layer's input, attention's output and logsumexp) is kept
as the tensor: that is the kept layer's memory, counted as it is packed (``held_bytes``, each storage once)
and predicted by the memory model's "kept activations" (``ModelShape.kept_bytes_per_token``).

A kept layer saves no boundary checkpoint (its graph holds its input), so it costs T x (kept bytes per
token - h x c) more than a recomputed one, and saves one layer forward in backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from megatrain.runtime.device.event_log import EventLog

RunLayer = Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]  # run(params, x) -> y, grad on


@dataclass(frozen=True)
class _WeightRef:
    """A saved view of a slot, by the block's identity: parameter, element offset in it, shape and stride."""
    name: str
    delta: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass
class _Graph:
    """One micro-batch's forward graph of a kept layer, and the weights its saved views are unpacked from."""
    x_in: torch.Tensor  # [b, S, hidden], requires grad
    leaves: dict[str, torch.Tensor]  # the forward's parameter leaves (identities for autograd.grad only)
    out: torch.Tensor  # [b, S, hidden], the graph's output
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # backward's views: where weights unpack from


class KeptGraphs:
    """The kept layers' graphs of one step, per (layer, micro-batch): [Note: kept layers]."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.kept: frozenset[int] = frozenset()
        self.step = 0
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._storages: dict[int, int] = {}  # data_ptr -> bytes of every activation storage this step's graphs hold
        self.held_bytes = 0  # activation bytes the graphs hold at the end of forward (tests compare the model)

    def begin(self, kept: frozenset[int]) -> None:
        """A new step keeping ``kept`` (decoder layer numbers); graphs of a step that stopped are dropped."""
        self.kept, self.step = kept, self.step + 1
        self._graphs.clear()
        self._storages.clear()
        self.held_bytes = 0

    def holds(self, layer: int) -> bool:
        return layer in self.kept

    def forward(self, layer: int, m: int, run: RunLayer, params: dict[str, torch.Tensor], x: torch.Tensor,
                step_owned: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        """Micro-batch m through ``layer`` (x [b, S, hidden] -> same) with its graph kept for backward.
        ``step_owned``: tensors the step holds anyway (RoPE's tables), not counted in ``held_bytes``."""
        x_in = x.detach().requires_grad_()
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        graph = _Graph(x_in, leaves, x_in)
        slot = next(iter(params.values())).untyped_storage().data_ptr()
        spans = [(v.storage_offset(), v.storage_offset() + v.numel(), k) for k, v in params.items()]
        owned = {t.untyped_storage().data_ptr() for t in step_owned}

        def count(t: torch.Tensor) -> None:
            storage = t.untyped_storage()
            if storage.data_ptr() not in owned:
                self._storages.setdefault(storage.data_ptr(), storage.nbytes())

        count(x_in)  # held by the graph's record whether or not autograd saves it

        def pack(t: torch.Tensor) -> object:
            if t.untyped_storage().data_ptr() != slot:
                count(t)
                return t
            o = t.storage_offset()
            lo, _, name = next(s for s in spans if s[0] <= o < s[1])
            return _WeightRef(name, o - lo, tuple(t.shape), tuple(t.stride()))

        def unpack(saved: object) -> torch.Tensor:
            if not isinstance(saved, _WeightRef):
                assert isinstance(saved, torch.Tensor)
                return saved
            p = graph.params[saved.name]  # the block's weights where it is resident for its backward
            return p.as_strided(saved.shape, saved.stride, p.storage_offset() + saved.delta)

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            graph.out = run(leaves, x_in)
        self._graphs[(layer, m)] = graph
        self.held_bytes = sum(self._storages.values())
        self.log.record("kept_forward", self.step, layer + 1, micro=m)
        return graph.out.detach()

    def backward(self, layer: int, m: int, params: dict[str, torch.Tensor], dy: torch.Tensor,
                 add: Callable[[dict[str, torch.Tensor]], None]) -> torch.Tensor:
        """Backprop dy ([b, S, hidden]) through micro-batch m's kept graph of ``layer``, its saved weights read
        from ``params`` (the views of the slot it is resident in now); the parameter gradients go to ``add``
        (by local name); returns the gradient w.r.t. the layer's input. The graph is freed."""
        graph = self._graphs.pop((layer, m))
        graph.params = params
        names = list(graph.leaves)
        grads = torch.autograd.grad(graph.out, (graph.x_in, *graph.leaves.values()), dy)
        self.log.record("kept_backward", self.step, layer + 1, micro=m)
        add(dict(zip(names, grads[1:])))
        return grads[0]
