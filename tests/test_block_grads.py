"""A block's gradients handed over into a buffer that was not zeroed (``BlockGrads``, grad_buffers.py): after
``close`` the buffer holds what zeroing it and adding every gradient gives, whatever it held before (here NaN, as
another block's gradients would be), its alignment gaps and tail included."""
from __future__ import annotations

import pytest
import torch

from megatrain.runtime.model.templates import BlockLayout, ParamEntry
from megatrain.runtime.pipeline.grad_buffers import BlockGrads

# Offsets as the layout aligns them (64 elements): gaps after "a" (40 of 64 used) and "c", a tail after "c".
LAYOUT = BlockLayout((ParamEntry("a", "x.a", (5, 8), 0, True), ParamEntry("b", "x.b", (64,), 64, True),
                      ParamEntry("c", "x.c", (3, 7), 128, False)), 192)
SHAPES = {e.local_name: e.shape for e in LAYOUT.entries}


def _reference(calls: list[dict[str, torch.Tensor]], numel: int) -> torch.Tensor:
    buf = torch.zeros(numel)
    views = LAYOUT.views(buf)
    for by_name in calls:
        for name, g in by_name.items():
            views[name].add_(g)
    return buf


@pytest.mark.parametrize("names", [
    [("a", "b", "c")],                       # one micro-batch, every parameter: all copied
    [("a", "b", "c"), ("a", "b", "c")],      # two micro-batches: copied, then added
    [("a", "b"), ("c",), ("a",), ("b", "c")],  # sequence tiles: each parameter first copied, then added
    [("b",), ("b",)],                        # parameters without a gradient are zeroed at close
    [],                                      # nothing at all: all zeros
])
def test_the_buffer_is_the_sum_as_if_zeroed_first(names: list[tuple[str, ...]]) -> None:
    gen = torch.Generator().manual_seed(len(names))
    calls = [{n: torch.randn(SHAPES[n], generator=gen) for n in call} for call in names]
    numel = 256  # the layout's 192 and a data-parallel padded tail
    buf = torch.full((numel,), float("nan"))
    grads = BlockGrads(LAYOUT, buf)
    for by_name in calls:
        grads.add(by_name)
    grads.close()
    assert torch.equal(buf, _reference(calls, numel))


def test_a_first_gradient_is_copied_not_added() -> None:
    """The first gradient of a parameter replaces what the buffer held (a NaN there would survive an add)."""
    buf = torch.full((192,), float("nan"))
    grads = BlockGrads(LAYOUT, buf)
    grads.add({"b": torch.ones(64)})
    assert torch.equal(buf[64:128], torch.ones(64))
    grads.add({"b": torch.ones(64)})
    assert torch.equal(buf[64:128], torch.full((64,), 2.0))
    assert torch.isnan(buf[:40]).all()  # not reached yet: zeroed by close
    grads.close()
    assert not torch.isnan(buf).any()


def test_a_buffer_holding_gradients_already_is_added_to() -> None:
    """A tied embedding's buffer holds lm_head's gradient when the embedding's come: added to it, not replaced."""
    held = torch.randn(192, generator=torch.Generator().manual_seed(1))
    for lo, hi in ((40, 64), (149, 192)):  # the gaps hold nothing, as in a buffer zeroed at the step's start
        held[lo:hi] = 0
    buf = held.clone()
    grads = BlockGrads(LAYOUT, buf, holding=True)
    g = torch.randn(64, generator=torch.Generator().manual_seed(2))
    grads.add({"b": g})
    grads.close()
    expected = held.clone()
    expected[64:128] += g
    assert torch.equal(buf, expected)
