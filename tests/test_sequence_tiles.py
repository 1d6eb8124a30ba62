"""The MLP with its norm, and the attention half's token-local work (norm, q/k/v, RoPE, o_proj), over sequence
tiles equal the untiled layer; no [B, S, intermediate] tensor, no whole-sequence fp32 norm copy exists.

Reference: the same ``DecoderLayer`` run whole under plain autograd. Forward outputs
are bitwise equal where BLAS runs the fewer rows through the same kernel (tiles of
8, 12, 64 of 48 tokens; one-row tiles take a matrix-vector kernel: noise); the backward's input gradient within
fp32 noise (its residual and attention terms are added in another order); parameter
gradients are sums over tokens taken tile by tile, so they agree to summation
order (rtol 1e-5). Tile sizes that divide the sequence and that do not.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from megatrain.runtime import ModelConfig
from megatrain.models.layers.attention import Documents
from megatrain.models.layers.decoder import DecoderLayer
from megatrain.models.layers.rope import inverse_frequencies, rotary_tables
from megatrain.runtime.model.sequence_tiles import tiled_layer_backward

CONFIG = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=88, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, mlp_bias=True, qk_norm=True)


def _layer(seed: int = 0) -> DecoderLayer:
    torch.manual_seed(seed)
    layer = DecoderLayer(CONFIG)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 and p.numel() in (8, 32) else 0.0))
    return layer


def _inputs(b: int, s: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    cos, sin = rotary_tables(inverse_frequencies(CONFIG), s, torch.device("cpu"))
    return torch.randn(b, s, 32, generator=gen), torch.randn(b, s, 32, generator=gen), (cos, sin, None)  # no documents


def assert_grad_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """A parameter gradient is a sum over tokens, taken tile by tile or at once: fp32 summation-order noise
    scales with the tensor's largest terms, so the absolute bound follows its largest element."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=max(1e-5, 2e-6 * want.abs().max().item()), msg=name)


def _untiled(layer: DecoderLayer, x: torch.Tensor, dy: torch.Tensor, rotary):
    x = x.clone().requires_grad_()
    params = dict(layer.named_parameters())
    out = layer(x, *rotary)
    grads = torch.autograd.grad(out, (x, *params.values()), dy)
    return out.detach(), grads[0], dict(zip(params, grads[1:]))


def _tiled(layer: DecoderLayer, x: torch.Tensor, dy: torch.Tensor, rotary, tile: int, attention_tile: int = 0):
    leaves = {n: p.detach().requires_grad_() for n, p in layer.named_parameters()}
    acc = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in leaves.items()}

    def add(by_name):
        for n, g in by_name.items():
            acc[n] += g

    def run(p, *args):
        return functional_call(layer, p, args, strict=True)

    with torch.no_grad():
        out = run(leaves, x, *rotary, tile, "layer", attention_tile)
    dx = tiled_layer_backward(lambda *args: run(leaves, *args), leaves, x.clone().requires_grad_(), dy, rotary, tile,
                              add, attention_tile)
    return out, dx, acc


@settings(max_examples=25, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(b=st.integers(1, 2), s=st.integers(2, 40), tile=st.integers(1, 41), seed=st.integers(0, 100))
def test_tiled_equals_untiled(b: int, s: int, tile: int, seed: int) -> None:
    layer = _layer(seed)
    x, dy, rotary = _inputs(b, s, seed)
    out, dx, grads = _untiled(layer, x, dy, rotary)
    t_out, t_dx, t_grads = _tiled(layer, x, dy, rotary, tile)
    torch.testing.assert_close(t_out, out, rtol=1e-5, atol=1e-5)  # bitwise where BLAS blocks rows alike
    torch.testing.assert_close(t_dx, dx, rtol=1e-5, atol=1e-5)
    for n in grads:
        assert_grad_close(t_grads[n], grads[n], n)


@pytest.mark.parametrize("tile", [8, 12, 64])  # divides 48, does not, covers it (one tile)
def test_forward_bitwise(tile: int) -> None:
    """Forward: the same rows through the same ops. (The input gradient is not bitwise even for one tile:
    the residual's gradient joins the attention half's in another order than one autograd graph adds them.)"""
    layer = _layer()
    x, dy, rotary = _inputs(2, 48)
    out, dx, _ = _untiled(layer, x, dy, rotary)
    t_out, t_dx, _ = _tiled(layer, x, dy, rotary, tile)
    assert torch.equal(t_out, out)
    torch.testing.assert_close(t_dx, dx, rtol=1e-5, atol=1e-5)


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op produced (of ``op`` only, when given)."""

    def __init__(self, op=None) -> None:
        super().__init__()
        self.op, self.largest = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.op is None or func.overloadpacket is self.op:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
        return out


def test_no_full_sequence_mlp_intermediate() -> None:
    """Untiled, a [B, S, intermediate] tensor exists; tiled by 16 of 256 tokens, nothing near it does."""
    layer = _layer()
    x, dy, rotary = _inputs(1, 256)
    with _LargestTensor() as untiled:
        _untiled(layer, x, dy, rotary)
    with _LargestTensor() as tiled:
        _tiled(layer, x, dy, rotary, 16)
    full = 256 * CONFIG.intermediate_size
    assert untiled.largest >= full  # the check can fail
    assert tiled.largest < full // 2, tiled.largest  # largest left: [B, heads, S, S]-free attention and [B, S, hidden]


def _packed_rotary(b: int, s: int, seed: int):
    """cos, sin gathered by position ids of packed rows (documents restart at 0) and their Documents."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.empty(b, s, dtype=torch.long)
    for r in range(b):
        cuts = sorted(torch.randperm(s - 1, generator=gen)[:2].add(1).tolist())
        starts = [0, *cuts]
        for a, e in zip(starts, [*cuts, s]):
            pos[r, a:e] = torch.arange(e - a)
    cos, sin = rotary_tables(inverse_frequencies(CONFIG), s, torch.device("cpu"))
    return cos[0][pos], sin[0][pos], Documents.from_position_ids(pos)


@settings(max_examples=25, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(b=st.integers(1, 2), s=st.integers(3, 40), tile=st.integers(1, 41), attention_tile=st.integers(1, 41),
       packed=st.booleans(), seed=st.integers(0, 100))
def test_attention_tiles_equal_untiled(b: int, s: int, tile: int, attention_tile: int, packed: bool,
                                       seed: int) -> None:
    """Both halves tiled (tile sizes that divide the sequence, that do not, and that cover it), whole rows or
    packed documents: forward, input gradient and every parameter gradient against one autograd graph."""
    layer = _layer(seed)
    x, dy, rotary = _inputs(b, s, seed)
    if packed:
        rotary = _packed_rotary(b, s, seed)
    out, dx, grads = _untiled(layer, x, dy, rotary)
    t_out, t_dx, t_grads = _tiled(layer, x, dy, rotary, tile, attention_tile)
    torch.testing.assert_close(t_out, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(t_dx, dx, rtol=1e-5, atol=1e-5)
    for n in grads:
        assert_grad_close(t_grads[n], grads[n], n)


@pytest.mark.parametrize("attention_tile", [8, 12, 64])
def test_attention_tiles_forward_bitwise(attention_tile: int) -> None:
    layer = _layer()
    x, dy, rotary = _inputs(2, 48)
    out, _, _ = _untiled(layer, x, dy, rotary)
    t_out, _, _ = _tiled(layer, x, dy, rotary, 48, attention_tile)
    assert torch.equal(t_out, out)


def test_no_whole_sequence_norm_with_both_halves_tiled() -> None:
    """Untiled (or MLP tiles only: the input norm still sees every token), RMSNorm squares [B, S, hidden] in
    fp32; with the attention half tiled by 16 of 256 tokens too, no norm sees more than a tile."""
    layer = _layer()
    x, dy, rotary = _inputs(1, 256)
    # the largest output of aten.pow: RMSNorm's fp32 square of its input, one per norm call
    with _LargestTensor(torch.ops.aten.pow) as untiled:
        _untiled(layer, x, dy, rotary)
    with _LargestTensor(torch.ops.aten.pow) as mlp_only:
        _tiled(layer, x, dy, rotary, 16)
    with _LargestTensor(torch.ops.aten.pow) as both:
        _tiled(layer, x, dy, rotary, 16, 16)
    assert untiled.largest == mlp_only.largest == 256 * CONFIG.hidden_size  # the check can fail
    assert both.largest == 16 * CONFIG.hidden_size
