"""A decoder layer's recompute-and-backward with its token-local half (norm + MLP) in sequence tiles.

[Note: sequence tiles]
At long context the MLP's intermediates (gate, up, activation: B x S x
intermediate each) are the largest tensors of a layer. The MLP and its norm are
token-local, so they run over tiles of ``Plan.mlp_tile_tokens`` tokens: forward
in ``DecoderLayer.forward``, and here in the backward: the attention half is
recomputed with autograd (h = x + attention(x)); then per tile, the MLP half is
recomputed from h's tile and backpropagated at once, its parameter gradients
added into the block's fp32 gradient buffer tile by tile and its input gradient
written into dh (which starts as dy: the residual); last, dh flows back through
the attention half. Live at once: h, dh (B x S x hidden each) and one tile's
intermediates (B x tile x intermediate x 3).

Exactness (fp32): the forward is the untiled one bit for bit where BLAS runs
the tile's rows through the same kernel (row-wise norm and matmuls; tested),
within rounding noise where it does not (one-row tiles); the backward differs in summation order only (the
project's noise bound): a parameter gradient is a sum over tokens, here taken
tile by tile in fp32, and dx adds the residual's and the attention half's
terms in another order than one autograd graph does.
"""
from __future__ import annotations

from typing import Callable

import torch

MLP_PREFIXES = ("mlp.", "post_attention_layernorm.")

RunLayer = Callable[..., torch.Tensor]  # run(params, x, cos, sin, documents, mlp_tile_tokens, part)
AddGrads = Callable[[dict[str, torch.Tensor]], None]  # adds gradients (by parameter name) into fp32


def tiled_layer_backward(run: RunLayer, leaves: dict[str, torch.Tensor], x_in: torch.Tensor, dy: torch.Tensor,
                         rotary: tuple, tile: int, add_grads: AddGrads) -> torch.Tensor:
    """Gradient w.r.t. x_in ([B, S, hidden], requires grad); parameter gradients go to ``add_grads``.
    ``rotary``: what the layer takes after x (cos, sin and the documents, see executor.Positions)."""
    mlp = {n: v for n, v in leaves.items() if n.startswith(MLP_PREFIXES)}
    attention = {n: v for n, v in leaves.items() if n not in mlp}
    with torch.enable_grad():
        h = run(leaves, x_in, *rotary, 0, "attention")
    dh = dy.clone()
    h_const = h.detach()
    for start in range(0, h.shape[1], tile):
        rows = slice(start, start + tile)
        h_tile = h_const[:, rows].requires_grad_()
        with torch.enable_grad():
            out = run(leaves, h_tile, *rotary, 0, "mlp")
        grads = torch.autograd.grad(out, (h_tile, *mlp.values()), dy[:, rows])
        dh[:, rows] += grads[0]
        add_grads(dict(zip(mlp, grads[1:])))
        del out, grads, h_tile
    grads = torch.autograd.grad(h, (x_in, *attention.values()), dh)
    add_grads(dict(zip(attention, grads[1:])))
    return grads[0]
