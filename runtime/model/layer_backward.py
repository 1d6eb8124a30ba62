"""A recomputed decoder layer's backward for one micro-batch, and where its parameter gradients add up.

A layer the plan does not keep ([Note: kept layers] in pipeline/kept_layers.py) runs its forward again from its
boundary checkpoint with autograd on, whole or in sequence tiles ([Note: sequence tiles] in sequence_tiles.py), and
backpropagates dy through it at once; a kept layer backpropagates through its forward's graph instead. Both hand
the parameter gradients to ``add_grads`` (the layer's ``BlockGrads.add``, pipeline/grad_buffers.py), which puts
them in the block's fp32 device buffer.
"""
from __future__ import annotations

import torch

from megatrain.runtime.model.compiled_layers import LayerRunner
from megatrain.runtime.model.sequence_tiles import AddGrads, tiled_layer_backward
from megatrain.runtime.model.templates import Block


def recompute_backward(run: LayerRunner, layer: Block, params: dict[str, torch.Tensor], x_in: torch.Tensor,
                       dy: torch.Tensor, positions: tuple, add_grads: AddGrads, mlp_tile: int,
                       attention_tile: int) -> torch.Tensor:
    """One micro-batch through ``layer`` again from its checkpoint x_in ([b, S, hidden]), autograd on: the
    parameter gradients go to ``add_grads`` (by local name); returns the gradient w.r.t. x_in. ``run``: how the
    executor runs the layer's template (compiled where the plan says so); ``mlp_tile`` / ``attention_tile`` > 0
    and below the sequence: in sequence tiles, the template's parameters bound once for all of them."""
    x_in = x_in.detach().requires_grad_()
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    seq = x_in.shape[1]
    if 0 < mlp_tile < seq or 0 < attention_tile < seq:  # [Note: sequence tiles]
        with run.bound(layer, leaves) as template:
            return tiled_layer_backward(template, leaves, x_in, dy, positions, mlp_tile if 0 < mlp_tile < seq else seq,
                                        add_grads, attention_tile)
    with torch.enable_grad():
        out = run(layer, leaves, x_in, *positions)
    grads = torch.autograd.grad(out, (x_in, *leaves.values()), dy)
    add_grads(dict(zip(leaves.keys(), grads[1:])))
    return grads[0]
