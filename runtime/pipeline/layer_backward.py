"""A recomputed decoder layer's backward for one micro-batch, and where its parameter gradients add up.

A layer the plan does not keep ([Note: kept layers] in kept_layers.py) runs its forward again from its boundary
checkpoint with autograd on, whole or in sequence tiles ([Note: sequence tiles] in sequence_tiles.py), and
backpropagates dy through it at once; a kept layer backpropagates through its forward's graph instead. Both add
the parameter gradients into the block's fp32 device buffer with ``grad_adder``.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from megatrain.runtime.model.templates import ParamEntry
from megatrain.runtime.pipeline.sequence_tiles import RunLayer, tiled_layer_backward

AddGrads = Callable[[dict[str, torch.Tensor]], None]  # adds gradients (by local name) into the fp32 buffer


def grad_adder(entries: Sequence[ParamEntry], g_list: list[torch.Tensor]) -> AddGrads:
    """Adds parameter gradients (by local name) into ``g_list`` (fp32, the block's layout order)."""
    index = {e.local_name: i for i, e in enumerate(entries)}

    def add_grads(by_name: dict[str, torch.Tensor]) -> None:
        names = list(by_name)
        torch._foreach_add_([g_list[index[n]] for n in names], [by_name[n] for n in names])
    return add_grads


def recompute_backward(run: RunLayer, entries: Sequence[ParamEntry], params: dict[str, torch.Tensor],
                       x_in: torch.Tensor, dy: torch.Tensor, positions: tuple, g_list: list[torch.Tensor],
                       mlp_tile: int, attention_tile: int) -> torch.Tensor:
    """One micro-batch through the layer again from its checkpoint x_in ([b, S, hidden]), autograd on: the
    parameter gradients add into ``g_list`` (fp32, layout order); returns the gradient w.r.t. x_in. ``run``: the
    layer's template (params, x, cos, sin, documents, ...); ``mlp_tile`` / ``attention_tile`` > 0 and below the
    sequence: in sequence tiles."""
    x_in = x_in.detach().requires_grad_()
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    seq = x_in.shape[1]
    if 0 < mlp_tile < seq or 0 < attention_tile < seq:  # [Note: sequence tiles]
        return tiled_layer_backward(run, leaves, x_in, dy, positions, mlp_tile if 0 < mlp_tile < seq else seq,
                                    grad_adder(entries, g_list), attention_tile)
    with torch.enable_grad():
        out = run(leaves, x_in, *positions)
    grads = torch.autograd.grad(out, (x_in, *leaves.values()), dy)
    by_name = dict(zip(leaves.keys(), grads[1:]))
    torch._foreach_add_(g_list, [by_name[e.local_name] for e in entries])
    return grads[0]
