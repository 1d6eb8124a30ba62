"""The template every registered model family runs: a tiny model of the family built by transformers, and

- equivalence: megatrain trained against transformers' own model on the same weights (fp32, AdamW, clipping):
  logits, each step's loss and the weights after the steps within float32 noise (``hf_reference``);
- Hugging Face round trip: ``save_pretrained`` of a model megatrain built (its config.json written by the family)
  loads in transformers with the same weights and logits, and reads back as the same ModelConfig;
- a model ``save_pretrained`` wrote (the dense families; the MoE ones: test_moe.py, test_gpt_oss.py) loads with
  ``Engine.from_pretrained``, trains 3 steps as transformers' model does and exports what it loaded
  (``hf_reference.assert_saved_trains_and_exports``);
- the planner's parameter count (the family's table) is ``sum(p.numel())`` of transformers' model.

A family is found in transformers by its ``model_type`` (``AutoConfig``) and ``architecture``. Seconds per family.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_reference import (assert_matches_transformers, assert_saved_trains_and_exports, batch,  # noqa: E402
                          randomize_norms_and_biases)
from megatrain.models import registry  # noqa: E402
from megatrain.planner.shapes import model_shapes  # noqa: E402
from megatrain.runtime import Engine, ModelConfig  # noqa: E402

# head_dim 12 differs from hidden / heads, so that a family reading it wrong shows.
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, max_position_embeddings=128, rms_norm_eps=1e-6, sliding_window=None)
# The mixture-of-experts families' sizes: 4 experts of width 16, 2 per token (Qwen2-MoE: a shared expert of 24).
MOE = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
       "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True),
       "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         shared_expert_intermediate_size=24)}
FAMILIES = registry.model_types()  # every family registered when the tests are collected
DENSE = [t for t in FAMILIES if t not in MOE and t != "gpt_oss"]
# Per family, what its transformers defaults need changed to fit the tiny model (Phi-3's token ids are > vocab).
# Gemma 3: a sliding layer (window 5, under the 20 tokens of a row) then a global one, and soft-capped logits.
TINY_EXTRA = {"phi3": dict(pad_token_id=None, bos_token_id=None, eos_token_id=None),
              "gemma3_text": dict(pad_token_id=None, bos_token_id=None, eos_token_id=None, sliding_window=5,
                                  layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=3.0,
                                  rope_scaling={"rope_type": "linear", "factor": 2.0}),
              "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16, sliding_window=5)}


def _hf_model(model_type: str, tied: bool):
    torch.manual_seed(1234)
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **TINY_EXTRA.get(model_type, {}),
                                                              **MOE.get(model_type, {})},
                                               tie_word_embeddings=tied)
    model = getattr(transformers, registry.family(model_type).architecture)(config).float()
    randomize_norms_and_biases(model)
    return config, model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_training_matches_transformers(model_type: str, tied: bool) -> None:
    config, hf = _hf_model(model_type, tied)
    mt_config = ModelConfig.from_hf(config.to_dict())
    assert mt_config.model_type == model_type and mt_config.head_dim == 12
    assert_matches_transformers(config.vocab_size, hf, mt_config, steps=2)


@pytest.mark.parametrize("model_type", DENSE)
def test_saved_by_transformers_trains_like_transformers_and_exports(tmp_path, model_type: str) -> None:
    _, hf = _hf_model(model_type, tied=False)
    hf.save_pretrained(tmp_path / "hf")
    assert ModelConfig.from_hf(tmp_path / "hf").model_type == model_type
    assert_saved_trains_and_exports(tmp_path / "hf", hf, tmp_path / "out")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_save_pretrained_loads_in_transformers(tmp_path, model_type: str) -> None:
    config, hf = _hf_model(model_type, tied=False)
    mt_config = ModelConfig.from_hf(config.to_dict())
    ids, _ = batch(config.vocab_size)
    with Engine(mt_config, compute_dtype=torch.float32, device="cpu", seed=3) as engine:
        engine.save_pretrained(tmp_path, dtype=torch.float32)  # no config.json given: the family writes it
        ours = engine.state_dict()
        logits = engine.logits(ids)
    assert ModelConfig.from_hf(tmp_path) == mt_config
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32)
    assert type(loaded).__name__ == registry.family(model_type).architecture
    theirs = loaded.state_dict()
    assert sorted(ours) == sorted(n for n, _ in loaded.named_parameters())
    for name, tensor in ours.items():
        assert torch.equal(theirs[name], tensor), name
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_planner_counts_the_parameters_transformers_has(model_type: str, tied: bool) -> None:
    config, hf = _hf_model(model_type, tied)
    shape = model_shapes.from_config(config.to_dict())
    assert shape.params == sum(p.numel() for p in hf.parameters())
    assert shape.params_layer == sum(p.numel() for p in hf.model.layers[0].parameters())

