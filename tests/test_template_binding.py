"""Binding a block's views into its stateless template (``TemplateBinding``) runs what ``torch.func.functional_call``
runs, bit for bit, and leaves the template as it was: meta parameters back after the ``with``, an outer binding back
after an inner one, a wrong set of names refused."""
from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

from megatrain.models.layers.rope import inverse_frequencies, rotary_tables
from megatrain.runtime import ModelConfig
from megatrain.runtime.model.templates import Templates

CONFIG = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, qk_norm=True, mlp_bias=True)


def _views(templates: Templates, block, seed: int) -> dict[str, torch.Tensor]:
    flat = torch.randn(block.layout.numel, generator=torch.Generator().manual_seed(seed)) * 0.2 + 0.5
    return block.layout.views(flat)


def _all_meta(module: torch.nn.Module) -> bool:
    return all(p.is_meta for p in module.parameters())


def test_bound_template_runs_as_functional_call_and_is_restored() -> None:
    templates = Templates(CONFIG, lambda name: True)
    layer = templates.layers[0]
    params = _views(templates, layer, 0)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1))
    cos, sin = rotary_tables(inverse_frequencies(CONFIG), 7, torch.device("cpu"))
    module = templates.module(layer)
    want = functional_call(module, params, (x, cos, sin), strict=True)
    assert torch.equal(templates.run(layer, params, x, cos, sin), want)
    assert _all_meta(module)
    with templates.bound(layer, params) as bound:
        assert bound is module and torch.equal(bound(x, cos, sin), want)
        other = _views(templates, layer, 2)
        with templates.bound(layer, other) as inner:  # nested: the inner binding's views, then the outer's again
            assert torch.equal(inner(x, cos, sin), functional_call(module, other, (x, cos, sin), strict=True))
        assert torch.equal(bound(x, cos, sin), want)
    assert _all_meta(module)


def test_binding_refuses_a_wrong_set_of_names() -> None:
    templates = Templates(CONFIG, lambda name: True)
    layer = templates.layers[0]
    params = _views(templates, layer, 0)
    params.pop(next(iter(params)))
    with pytest.raises(AssertionError, match="missing"):
        with templates.bound(layer, params):
            pass
    assert _all_meta(templates.module(layer))
