"""A decoder layer's recompute-and-backward with its token-local work in sequence tiles.

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

The attention half's token-local work (input norm, q/k/v projections, RoPE;
o_proj) tiles the same way with ``Plan.attention_tile_tokens``: forward
(``DecoderLayer._tiled_attention``) builds q, k, v tile by tile, runs one
attention call over the whole sequence and o_proj tile by tile; here q, k, v
are rebuilt tile by tile without a graph, attention alone runs with autograd,
o_proj is backpropagated tile by tile into attention's output gradient, the
attention call's backward gives dq, dk, dv, and last the projections are
recomputed and backpropagated tile by tile into dx (which starts as dh: the
residual). Live at once: q, k, v, attention's output and its gradient, dq, dk,
dv, h and dh, and one tile's norm and projection intermediates; never the
whole sequence's norm output, pre-RoPE q and k, or fp32 norm copies.

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

from megatrain.models.layers.decoder import rope_rows, tile_projections


Layer = Callable[..., torch.Tensor]  # layer(x, cos, sin, documents, mlp_tile_tokens, part), its leaves bound
AddGrads = Callable[[dict[str, torch.Tensor]], None]  # adds gradients (by parameter name) into fp32
Finish = Callable[[torch.Tensor], torch.Tensor]       # dh -> gradient w.r.t. the layer's input


def tiled_layer_backward(layer: Layer, leaves: dict[str, torch.Tensor], x_in: torch.Tensor, dy: torch.Tensor,
                         rotary: tuple, tile: int, add_grads: AddGrads, attention_tile: int = 0) -> torch.Tensor:
    """Gradient w.r.t. x_in ([B, S, hidden], requires grad); parameter gradients go to ``add_grads``.
    ``layer``: the layer's template with ``leaves`` bound once for all its calls here (``Templates.bound``: a
    one-token tile's work is small, binding the parameters on each call would cost more).
    ``rotary``: what the layer takes after x (cos, sin and the documents, see rotary_positions.Positions); ``tile``:
    tokens per MLP tile (the whole sequence: one tile); ``attention_tile`` > 0: the attention half's
    token-local work in tiles of that many tokens too."""
    if 0 < attention_tile < x_in.shape[1]:
        h, finish = _attention_half_in_tiles(layer, leaves, x_in, rotary, attention_tile, add_grads)
    else:
        h, finish = _attention_half(layer, leaves, x_in, rotary, add_grads)
    dh = dy.clone()
    h_const = h.detach()
    for start in range(0, h.shape[1], tile):
        rows = slice(start, start + tile)
        h_tile = h_const[:, rows].requires_grad_()
        with torch.enable_grad():
            out = layer(h_tile, *rotary, 0, "mlp")
        grads = torch.autograd.grad(out, (h_tile, *leaves.values()), dy[:, rows], allow_unused=True)
        dh[:, rows] += grads[0]
        _add_used(add_grads, leaves, grads[1:])
        del out, grads, h_tile
    del h, h_const  # the attention half's backward needs dh only (the untiled one keeps its graph in ``finish``)
    return finish(dh)


def _attention_half(layer: Layer, leaves: dict[str, torch.Tensor], x_in: torch.Tensor, rotary: tuple,
                    add_grads: AddGrads) -> tuple[torch.Tensor, Finish]:
    """h = x + attention(x) with one autograd graph, and the backward through it."""
    with torch.enable_grad():
        h = layer(x_in, *rotary, 0, "attention")

    def finish(dh: torch.Tensor) -> torch.Tensor:
        grads = torch.autograd.grad(h, (x_in, *leaves.values()), dh, allow_unused=True)
        _add_used(add_grads, leaves, grads[1:])
        return grads[0]
    return h, finish


def _attention_half_in_tiles(layer: Layer, leaves: dict[str, torch.Tensor], x_in: torch.Tensor, rotary: tuple,
                             tile: int, add_grads: AddGrads) -> tuple[torch.Tensor, Finish]:
    """h = x + attention(x) with the token-local work in tiles (see the note), and the backward through it."""
    cos, sin, documents = rotary
    seq = x_in.shape[1]
    x = x_in.detach()
    tiles = [slice(start, start + tile) for start in range(0, seq, tile)]
    with torch.no_grad():
        q, k, v = tile_projections(lambda rows: layer(x[:, rows], *rope_rows(cos, sin, rows), None, 0, "project"),
                                   seq, tile)
    qkv = tuple(t.requires_grad_() for t in (q, k, v))
    with torch.enable_grad():
        out = layer(qkv, cos, sin, documents, 0, "core")
    o = out.detach()
    with torch.no_grad():
        h = torch.empty_like(x)
        for rows in tiles:
            h[:, rows] = x[:, rows] + layer(o[:, :, rows], cos, sin, None, 0, "output")

    def finish(dh: torch.Tensor) -> torch.Tensor:
        d_out = torch.empty_like(o)
        for rows in tiles:  # o_proj, tile by tile, into attention's output gradient
            o_tile = o[:, :, rows].requires_grad_()
            with torch.enable_grad():
                y = layer(o_tile, cos, sin, None, 0, "output")
            grads = torch.autograd.grad(y, (o_tile, *leaves.values()), dh[:, rows], allow_unused=True)
            d_out[:, :, rows] = grads[0]
            _add_used(add_grads, leaves, grads[1:])
            del y, grads, o_tile
        grads = torch.autograd.grad(out, (*qkv, *leaves.values()), d_out, allow_unused=True)
        dq, dk, dv = grads[:3]
        _add_used(add_grads, leaves, grads[3:])  # the attention core's own parameters (gpt-oss's sinks), if any
        del d_out
        dx = dh  # the residual's share; each tile adds the projections' share
        for rows in tiles:
            x_tile = x[:, rows].requires_grad_()
            with torch.enable_grad():
                parts = layer(x_tile, *rope_rows(cos, sin, rows), None, 0, "project")
            grads = torch.autograd.grad(parts, (x_tile, *leaves.values()),
                                        (dq[:, :, rows], dk[:, :, rows], dv[:, :, rows]), allow_unused=True)
            dx[:, rows] += grads[0]
            _add_used(add_grads, leaves, grads[1:])
            del parts, grads, x_tile
        return dx
    return h, finish


def _add_used(add_grads: AddGrads, leaves: dict[str, torch.Tensor], grads: tuple) -> None:
    """The gradients of the parameters a part used (its graph decides which: the family's norms may sit in
    either half), by name."""
    used = {n: g for n, g in zip(leaves, grads) if g is not None}
    if used:
        add_grads(used)
