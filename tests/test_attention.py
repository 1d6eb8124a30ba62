"""Causal attention in head groups equals one SDPA call; the groups keep GQA's sharing and the 2^31 bound."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from megatrain.models.layers.attention import causal_attention, head_groups
from megatrain.runtime.errors import AttentionBackendError


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), s=st.integers(1, 64), d=st.sampled_from([4, 8]), n_kv=st.sampled_from([1, 2, 3, 4]),
       n_rep=st.sampled_from([1, 2, 4]), limit=st.integers(1, 4000))
def test_groups_cover_every_head_once_within_the_bound(b, s, d, n_kv, n_rep, limit) -> None:
    per_head = b * s * d
    if per_head > limit:
        with pytest.raises(AttentionBackendError, match="over 2\\^31"):
            head_groups(b, s, d, n_kv * n_rep, n_kv, limit)
        return
    groups = head_groups(b, s, d, n_kv * n_rep, n_kv, limit)
    q_heads = [h for qh, _ in groups for h in range(qh.start, qh.stop)]
    assert q_heads == list(range(n_kv * n_rep))
    for qh, kh in groups:
        assert (qh.stop - qh.start) * per_head <= limit
        # every query head meets its own kv head: query h shares kv head h // n_rep
        assert [h // n_rep for h in range(qh.start, qh.stop)] == [
            kh.start + i // ((qh.stop - qh.start) // (kh.stop - kh.start)) for i in range(qh.stop - qh.start)]
    if n_kv * n_rep * per_head <= limit:
        assert len(groups) == 1  # one call when everything fits


@pytest.mark.parametrize("limit", [None, 2 * 40 * 8 * 4, 2 * 40 * 8 * 2, 2 * 40 * 8])  # 1 group .. 1 query head each
def test_grouped_equals_one_call_forward_and_backward(limit) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 8, 40, 8, requires_grad=True)  # 8 query heads over 2 kv heads
    k = torch.randn(2, 2, 40, 8, requires_grad=True)
    v = torch.randn(2, 2, 40, 8, requires_grad=True)
    dy = torch.randn(2, 8, 40, 8)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dy)
    kwargs = {} if limit is None else {"max_elements": limit}
    out = causal_attention(q, k, v, scale=0.3, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), dy)
    assert len(head_groups(2, 40, 8, 8, 2, **kwargs)) == {None: 1, 640: 8, 1280: 4, 2560: 2}[limit]
    assert torch.equal(out, ref)
    assert torch.equal(grads[0], ref_grads[0])
    for g, r in zip(grads[1:], ref_grads[1:]):  # k, v: sums over query heads, in per-group partial sums
        torch.testing.assert_close(g, r, rtol=2e-6, atol=1e-6)


def test_causal_without_a_mask() -> None:
    """The last position's output moves with the first key; the first position's does not see the last."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    out = causal_attention(q, k, v, scale=0.5)
    v2 = v.clone()
    v2[:, :, -1] += 1.0
    out2 = causal_attention(q, k, v2, scale=0.5)
    assert torch.equal(out[:, :, :-1], out2[:, :, :-1]) and not torch.equal(out[:, :, -1], out2[:, :, -1])
