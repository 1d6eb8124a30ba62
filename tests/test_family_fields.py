"""A family's own config field: declared by a toy family registered here alone (no product file touched), read from
a config.json dict, it reaches the runtime's layer template and the planner's parameter arithmetic.

The toy is a Llama whose MLP input passes through ``extra_norms`` more RMSNorms (a field no built-in family has;
config.json absent: 1). Its stdlib half declares the field (``FamilyField``: name, default, check), reads it
(``read``) and sizes it (its layer table); its torch half (this module, ``FAMILY.blocks``) builds the norms from
``config.extra_norms``. The planner's counts are checked against a hand count, the runtime's template against
its behaviour (zeroed norms feed the MLP nothing) and its layout against the planner's.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

import pytest
import torch
from torch import nn

from megatrain.models import registry
from megatrain.models.config_fields import attention_biases, fixed_flag, integer
from megatrain.models.errors import ConfigError
from megatrain.models.family import Family, FamilyField
from megatrain.models.layers.decoder import DecoderLayer as LlamaDecoderLayer
from megatrain.models.layers.decoder import EmbeddingBlock, HeadBlock, RMSNorm  # noqa: F401 (the toy's blocks)
from megatrain.models.layers.rope import inverse_frequencies, rotary_tables
from megatrain.models.parameters import Param, llama_layer
from megatrain.planner.shapes import model_shapes
from megatrain.runtime import ModelConfig
from megatrain.runtime.model.templates import Templates

MODEL_TYPE = "toy_extra_norms"


# ---- the toy family's stdlib half: its field, config rules and parameter table -------------------------------

def norm_count(name: str, value: Any) -> int:
    """The field's check: an integer >= 0."""
    if integer(name, value) < 0:
        raise ConfigError(f"{name}={value!r} must be an integer >= 0; fix it in the config")
    return value


def read(data: Mapping[str, Any], num_hidden_layers: int) -> dict[str, Any]:
    return {**attention_biases(MODEL_TYPE, data, mlp=False), "qk_norm": fixed_flag(MODEL_TYPE, data, "qk_norm", False),
            "sliding_window": None, "extra_norms": data.get("extra_norms", 1)}


def layer(dims: Mapping[str, Any]) -> tuple[Param, ...]:
    """Llama's layer, then the extra norms."""
    return (*llama_layer(dims),
            *(Param(f"extra_norms.{i}.weight", (dims["hidden_size"],)) for i in range(dims["extra_norms"])))


FAMILY = Family(model_type=MODEL_TYPE, architecture="ToyForCausalLM", read=read,
                write=lambda config: {"extra_norms": config.extra_norms}, layer=layer, blocks=__name__,
                fields=(FamilyField("extra_norms", 0, norm_count),))


# ---- the toy family's torch half: its decoder layer ---------------------------------------------------------

class DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.extra_norms = nn.ModuleList(RMSNorm(config.hidden_size, config.rms_norm_eps)
                                         for _ in range(config.extra_norms))

    def mlp_branch(self, h: torch.Tensor) -> torch.Tensor:
        x = self.post_attention_layernorm(h)
        for norm in self.extra_norms:
            x = norm(x)
        return self.mlp(x)


@pytest.fixture
def toy() -> Iterator[Family]:
    registry.register(FAMILY)
    try:
        yield FAMILY
    finally:
        registry.unregister(MODEL_TYPE)


# h 32, intermediate 48, 4 heads of 8 (q width 32), 2 kv heads (kv width 16); no biases.
HF = dict(model_type=MODEL_TYPE, vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
# One layer by hand: q 32x32, k and v 32x16 each, o 32x32; gate, up, down 32x48 each; two norms of 32.
LLAMA_LAYER = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 48 + 2 * 32


def test_a_family_field_reaches_the_planner_and_the_runtime(toy: Family) -> None:
    config = ModelConfig.from_hf({**HF, "extra_norms": 3})
    assert config.extra_norms == 3 and dict(config.family_fields) == {"extra_norms": 3}

    # The planner: the shape of that config, and of the config.json itself, counts the three norms.
    for shape in (model_shapes.of_model(config), model_shapes.from_config({**HF, "extra_norms": 3})):
        assert shape.params_layer == LLAMA_LAYER + 3 * 32
        assert shape.numel_layer == sum(-(-n // 64) * 64 for n in shape.layer_params())
    assert model_shapes.from_config(HF).params_layer == LLAMA_LAYER + 32  # absent: the family's read gives 1

    # The runtime: the layer template holds them, laid out as the planner sized the layer.
    templates = Templates(config, lambda name: True)
    layer_block = templates.layers[0]
    names = [e.local_name for e in layer_block.layout.entries]
    assert names[-3:] == ["extra_norms.0.weight", "extra_norms.1.weight", "extra_norms.2.weight"]
    assert layer_block.layout.numel == model_shapes.of_model(config).numel_layer

    # ... and runs them: with one of them zeroed the MLP sees zeros, so the layer adds attention's output alone.
    torch.manual_seed(0)
    flat = torch.randn(layer_block.layout.numel)
    params = layer_block.layout.views(flat)
    x = torch.randn(1, 5, 32)
    cos, sin = rotary_tables(inverse_frequencies(config), 5, torch.device("cpu"))
    attention_only = templates.run(layer_block, params, x, cos, sin, None, 0, "attention")
    assert not torch.allclose(templates.run(layer_block, params, x, cos, sin), attention_only)
    params["extra_norms.1.weight"].zero_()
    torch.testing.assert_close(templates.run(layer_block, params, x, cos, sin), attention_only, rtol=0, atol=0)


def test_a_family_field_is_checked_and_defaulted_by_its_family(toy: Family) -> None:
    with pytest.raises(ConfigError, match="extra_norms=-1 must be an integer >= 0"):
        ModelConfig.from_hf({**HF, "extra_norms": -1})
    with pytest.raises(model_shapes.ModelShapeError, match="extra_norms=-1"):
        model_shapes.from_config({**HF, "extra_norms": -1})
    with pytest.raises(ConfigError, match="extra_norms='2' must be an integer"):
        ModelConfig(**HF, extra_norms="2")
    # Built without it: the declared default; another family has no such field.
    built = ModelConfig(**HF)
    assert built.extra_norms == 0 and built.to_dict()["extra_norms"] == 0
    assert ModelConfig(**built.to_dict()) == built
    with pytest.raises(ConfigError, match="extra_norms=2 is not a field of model_type='llama'"):
        ModelConfig(**{**HF, "model_type": "llama"}, extra_norms=2)
    assert ModelConfig(**{**HF, "model_type": "llama"}).family_field("extra_norms") is None
