"""The executor's work on the loads of a layer streamed in parts: its dense part and its expert groups.

What each load computes is [Note: expert groups] (expert_parts.py); the torch of it is
``megatrain.models.layers.expert_group``. The executor hands every load with a ``part`` here, in the order of
the load sequence; a layer's state between its loads (the routed micro-batches, the accumulators, the host
gradient sink) lives here from its first load to its last. It works with what the executor hands it: the block
templates, the step's routing, its activation checkpoints, its gradient buffers and its block updates (a block's
norms, its host gradient sink and its hand-off to the optimizer).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch.profiler import record_function

from megatrain.models.layers import expert_group
from megatrain.models.layers.expert_group import Routed, Routing

from megatrain.runtime.device.streams import Event
from megatrain.runtime.model.rotary_positions import Positions
from megatrain.runtime.model.templates import BlockKind, Templates
from megatrain.runtime.optim.adamw_kernel import AdamHyper
from megatrain.runtime.pipeline.activation_checkpoints import DeviceCheckpoints, HostCheckpoints
from megatrain.runtime.pipeline.block_updates import BlockUpdates, PendingUpdate
from megatrain.runtime.pipeline.experts.router_balance import RouterBalance
from megatrain.runtime.pipeline.grad_buffers import GradBuffers
from megatrain.runtime.pipeline.step_schedule import Load
from megatrain.runtime.state.host_store import GradSink


class _Backward(NamedTuple):
    inputs: list[torch.Tensor]  # per micro-batch, the layer's input [b, S, hidden] (its checkpoint)
    tokens: list[torch.Tensor]  # per micro-batch, the routed tokens [b x S, hidden] (without a graph)
    routing: list[Routing]
    d_tokens: list[torch.Tensor]  # per micro-batch, the gradient of the routed tokens [b x S, hidden], over groups
    d_weights: list[torch.Tensor]  # per micro-batch, the gradient of the routing weights [b x S, k], over groups
    squares: torch.Tensor  # [entries of the block] fp32: each parameter's squared gradient norm, over parts
    sink: list[GradSink]  # the block's host gradient sink, taken at its first drain
    done: list[Event]  # the last drain's event


class ExpertLayers:
    def __init__(self, templates: Templates, routing: RouterBalance, checkpoints: DeviceCheckpoints | HostCheckpoints,
                 grad_buffers: GradBuffers, updates: BlockUpdates, attention_tile: int) -> None:
        """``routing``: the recomputed router's logits take the load-balancing loss's gradient; ``checkpoints``: the
        layer's inputs, saved by the forward's dense part; ``attention_tile``: the dense part's attention tiles
        (``Plan.attention_tile_tokens``, 0: none)."""
        self.layers = templates.layer_modules  # per layer type ([Note: layer types]): the dense part's
        self.layer = templates.modules[BlockKind.LAYER]  # the experts' (alike in every layer type)
        self.routing, self.checkpoints = routing, checkpoints
        self.grad_buffers, self.updates = grad_buffers, updates
        self.attention_tile = attention_tile
        # host checkpoints hand out buffers they reuse: the backward copies a layer's inputs to keep them from its
        # first dense load to its last
        self.keep_inputs = isinstance(checkpoints, HostCheckpoints)
        self._forward: dict[int, tuple[list[Routed], list[torch.Tensor]]] = {}  # per layer: routed, experts' sum
        self._backward: dict[int, _Backward] = {}

    def _dense(self, load: Load, params: dict[str, torch.Tensor], x: torch.Tensor, positions: Positions) -> Routed:
        layer = self.layers[load.block.layer_type]
        return expert_group.dense(layer, params, x, *positions, self.attention_tile)

    # ------------------------------------------------------------------ forward (no grad)
    def forward(self, load: Load, params: dict[str, torch.Tensor], x: list[torch.Tensor], micro: list[slice],
                positions: list[Positions], training: bool) -> None:
        """One load of a layer's forward over every micro-batch; after its last group, x[m] is the layer's output.
        ``training``: the dense part saves the layer's inputs as activation checkpoints."""
        part, layer = load.part, load.layer
        assert part is not None
        if part.number == 0:
            routed = []
            for m, rows in enumerate(micro):
                if training:
                    self.checkpoints.save(layer, m, rows, x[m])
                routed.append(self._dense(load, params, x[m], positions[m]))
            self._forward[layer] = (routed, [torch.zeros_like(r.tokens) for r in routed])
            return
        routed, sums = self._forward[layer]
        for r, out in zip(routed, sums):
            expert_group.add_group(self.layer, out, r.tokens, r.routing, params, part.experts.start)
        if part.last:
            del self._forward[layer]
            for m, (r, out) in enumerate(zip(routed, sums)):
                x[m] = expert_group.finish(r, out)

    # ------------------------------------------------------------------ backward
    def _keep(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone() if self.keep_inputs else x

    def backward(self, step: int, load: Load, params: dict[str, torch.Tensor], micro: list[slice],
                 positions: list[Positions], dy: list[torch.Tensor], hyper: AdamHyper) -> list[PendingUpdate]:
        """One load of a layer's backward; after its last (the dense part again), dy[m] is the gradient of the
        layer's input and the block's update is handed on (returned when deferred)."""
        part, layer = load.part, load.layer
        assert part is not None
        state = self._backward.get(layer)
        if state is None:  # the first dense load: the routing again, from the checkpoints
            # each copied before the next get: that one reloads into the buffer before it
            inputs = [self._keep(self.checkpoints.get(layer, m, rows)) for m, rows in enumerate(micro)]
            tokens, routing = [], []
            with torch.no_grad():
                for x, p in zip(inputs, positions):
                    r = self._dense(load, params, x, p)  # h and the shared term are not kept: the third load's own
                    tokens.append(r.tokens)
                    routing.append(r.routing)
            squares = torch.zeros(len(load.block.layout.entries), dtype=torch.float32, device=dy[0].device)
            self._backward[layer] = _Backward(inputs, tokens, routing, [torch.zeros_like(t) for t in tokens],
                                              [torch.zeros_like(r.weights) for r in routing], squares, [], [])
            return []
        g_index, g_buf = self.grad_buffers.acquire(part.numel)
        grads = part.layout.views(g_buf)
        with record_function(f"bwd[{load.block.index}.{part.number}]"):
            if part.number > 0:
                for m in range(len(micro)):
                    self._group_backward(state, m, params, grads, dy[m], part.experts.start)
            else:
                for m in range(len(micro)):
                    dy[m] = self._dense_backward(load, state, m, params, grads, dy[m], positions[m])
        self._drain(state, load, g_index, g_buf)
        if part.number > 0:
            return []
        del self._backward[layer]
        self.updates.record_norms(load.block, state.squares.sqrt())
        return self.updates.hand_off(step, load.block, state.sink[0], state.done[0], hyper)

    def _group_backward(self, state: _Backward, m: int, params: dict[str, torch.Tensor],
                        grads: dict[str, torch.Tensor], dy: torch.Tensor, first: int) -> None:
        """Group's experts over micro-batch m with autograd: their gradients into ``grads``, those of the routed
        tokens and weights added into the layer's sums."""
        routing = state.routing[m]
        tokens = state.tokens[m].detach().requires_grad_()
        weights = routing.weights.detach().requires_grad_()
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}  # the group's rows of each fused tensor
        with torch.enable_grad():
            out = torch.zeros_like(tokens)
            ran = expert_group.add_group(self.layer, out, tokens, Routing(weights, routing.pairs), leaves, first)
        if not ran:  # no token reached these experts: their gradient stays zero
            return
        d = torch.autograd.grad(out, (tokens, weights, *leaves.values()), dy.reshape(out.shape))
        state.d_tokens[m].add_(d[0])
        state.d_weights[m].add_(d[1])
        torch._foreach_add_([grads[n] for n in leaves], list(d[2:]))

    def _dense_backward(self, load: Load, state: _Backward, m: int, params: dict[str, torch.Tensor],
                        grads: dict[str, torch.Tensor], dy: torch.Tensor, positions: Positions) -> torch.Tensor:
        """The dense part recomputed from micro-batch m's input with autograd and backpropagated: dy into h and the
        shared term, the groups' sums into the routed tokens and weights. Returns the gradient of the input."""
        x = state.inputs[m].detach().requires_grad_()
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        with torch.enable_grad(), self.routing.backward():
            r = self._dense(load, leaves, x, positions)
        outputs = [r.h, r.tokens, r.routing.weights]
        seeds = [dy, state.d_tokens[m], state.d_weights[m]]
        if r.shared is not None:
            outputs.append(r.shared)
            seeds.append(dy.reshape(r.shared.shape))
        d = torch.autograd.grad(outputs, (x, *leaves.values()), seeds)
        torch._foreach_add_([grads[n] for n in leaves], list(d[1:]))
        return d[0]

    def _drain(self, state: _Backward, load: Load, g_index: int, g_buf: torch.Tensor) -> None:
        """The part's gradient norms (as squares, per block entry) and its drain into the block's host gradient at
        the part's ranges (the sink taken at the layer's first drain: an eager-mode slab may wait for AdamW)."""
        part = load.part
        assert part is not None
        norms = torch._foreach_norm(part.layout.view_list(g_buf), 2.0)
        index = torch.tensor(part.entries, device=g_buf.device)
        state.squares.index_add_(0, index, torch.stack(norms).square())
        if not state.sink:
            state.sink.append(self.updates.grad_sink(load.block))
        host = state.sink[0].host
        with record_function(f"d2h[{load.block.index}.{part.number}]"):
            for lo, n, at in part.ranges:
                done = self.grad_buffers.drain(g_index, g_buf[at:at + n], host[lo:lo + n])
        state.sink[0].on_drained(done)
        state.done[:] = [done]
