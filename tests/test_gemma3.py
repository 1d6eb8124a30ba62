"""Gemma 3 (``gemma3_text``) beyond the family template of test_families.py: three steps against transformers over
sliding and global layers; its config.json read as transformers' ``Gemma3TextConfig`` reads it (both RoPE
spellings, the layer pattern); what it refuses; a new model's (1 + w) norms; sequence tiles and packed documents
over its sliding and global layers; the Gemma-3-27B preset's size.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_reference import (assert_matches_transformers, assert_packed_documents_match_transformers, batch,  # noqa: E402
                          randomize_norms_and_biases)
from megatrain.planner.shapes import model_shapes  # noqa: E402
from megatrain.runtime import ConfigError, Engine, ModelConfig, Plan  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, max_position_embeddings=128, pad_token_id=None, bos_token_id=None,
            eos_token_id=None)
# Hub configs carry the old spelling: rope_theta, rope_scaling and rope_local_base_freq, sliding_window_pattern.
OLD_SPELLING = dict(model_type="gemma3_text", rope_theta=5e5, rope_local_base_freq=2e4, sliding_window=5,
                    sliding_window_pattern=3, rope_scaling={"rope_type": "linear", "factor": 8.0},
                    query_pre_attn_scalar=168, final_logit_softcapping=30.0)


def _hf(**extra):
    torch.manual_seed(11)
    config = transformers.Gemma3TextConfig(**{**TINY, "sliding_window": 5, "sliding_window_pattern": 2,
                                              "final_logit_softcapping": 3.0, **extra})
    model = transformers.Gemma3ForCausalLM(config).float()
    randomize_norms_and_biases(model)
    return config, model


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_three_steps_match_transformers(tied: bool) -> None:
    """Two sliding layers (window 5 under 20-token rows) and two global ones with a scaled RoPE, soft-capped logits:
    logits, three fp32 AdamW steps with clipping and the weights after them, against transformers."""
    config, hf = _hf(tie_word_embeddings=tied, rope_scaling={"rope_type": "linear", "factor": 2.0})
    mt_config = ModelConfig.from_hf(config.to_dict())
    assert mt_config.layer_types == ("sliding_attention", "full_attention") * 2 and mt_config.rope_scaling
    assert_matches_transformers(config.vocab_size, hf, mt_config, steps=3)


def test_a_directory_transformers_saved_loads_and_exports_the_same(tmp_path) -> None:
    config, hf = _hf(rope_scaling={"rope_type": "linear", "factor": 2.0})
    hf.save_pretrained(tmp_path / "hf")
    ids, _ = batch(config.vocab_size)
    with Engine.from_pretrained(tmp_path / "hf", compute_dtype=torch.float32, device="cpu") as engine:
        ours = engine.state_dict()
        logits = engine.logits(ids)
        engine.save_pretrained(tmp_path / "out", dtype=torch.float32)
    theirs = hf.state_dict()
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[n], theirs[n]) for n in theirs)
    with torch.no_grad():
        torch.testing.assert_close(logits, hf(ids).logits, rtol=0, atol=1e-5)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert type(loaded).__name__ == "Gemma3ForCausalLM" and loaded.config.layer_types == config.layer_types
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in theirs.items())


@pytest.mark.parametrize("data", [OLD_SPELLING, {"model_type": "gemma3_text"}, dict(OLD_SPELLING, rope_scaling=None),
                                  dict(OLD_SPELLING, layer_types=["full_attention", "sliding_attention"] * 2)])
def test_config_reads_as_transformers_reads_it(data: dict) -> None:
    theirs = transformers.Gemma3TextConfig(**{**TINY, **data})
    for source in (dict(data, **TINY), theirs.to_dict()):  # the file as written, and as transformers 5 writes it
        ours = ModelConfig.from_hf(source)
        assert list(ours.layer_types) == theirs.layer_types
        assert ours.sliding_window == theirs.sliding_window
        full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
        assert ours.rope_theta == full["rope_theta"] and ours.rope_local_base_freq == local["rope_theta"]
        assert (ours.rope_scaling or {}).get("factor") == full.get("factor") and local["rope_type"] == "default"
        assert ours.query_pre_attn_scalar == theirs.query_pre_attn_scalar
        assert ours.final_logit_softcapping == theirs.final_logit_softcapping
        assert ours.hidden_act == theirs.hidden_activation and ours.tie_word_embeddings == theirs.tie_word_embeddings


@pytest.mark.parametrize("extra, words", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(sliding_window=None), "sliding_window"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "sliding_attention"),
    (dict(layer_types=["sliding_attention"] * 3), "layer_types"),
])
def test_what_megatrain_does_not_build_is_refused_in_one_line(extra: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words) as err:
        ModelConfig.from_hf({**TINY, "model_type": "gemma3_text", **extra})
    assert "\n" not in str(err.value)


def test_a_new_model_starts_with_unit_norms_and_its_logits_are_transformers() -> None:
    config, _ = _hf()
    ids, _ = batch(config.vocab_size)
    with Engine(ModelConfig.from_hf(config.to_dict()), compute_dtype=torch.float32, device="cpu", seed=5) as engine:
        state = engine.state_dict()
        logits = engine.logits(ids)
    norms = [n for n in state if n.endswith("norm.weight")]
    assert len(norms) == 4 * 6 + 1 and all(torch.equal(state[n], torch.zeros_like(state[n])) for n in norms)
    hf = transformers.Gemma3ForCausalLM(config).float()
    hf.load_state_dict(state)
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert logits.abs().max() <= config.final_logit_softcapping


def test_sequence_tiles_and_packed_documents_over_sliding_and_global_layers() -> None:
    config, hf = _hf()
    ids, labels = batch(config.vocab_size)
    runs = []
    for plan in (Plan(micro_batch_size=1), Plan(micro_batch_size=1, mlp_tile_tokens=3, attention_tile_tokens=7)):
        with Engine(ModelConfig.from_hf(config.to_dict()), plan=plan, compute_dtype=torch.float32,
                    device="cpu") as engine:
            engine.load_state_dict(hf.state_dict())
            runs.append(([engine.step(ids, labels).item() for _ in range(2)], engine.state_dict()))
    (plain, plain_state), (tiled, tiled_state) = runs
    assert plain == pytest.approx(tiled, abs=1e-6)
    for name, tensor in plain_state.items():
        torch.testing.assert_close(tiled_state[name], tensor, rtol=0, atol=1e-5)

    lengths = [[13, 7], [4, 16]]
    assert_packed_documents_match_transformers(hf, ModelConfig.from_hf(config.to_dict()), ids[:2], lengths)


def test_gemma_3_27b_preset_has_the_published_size() -> None:
    """google/gemma-3-27b-pt's text model: 27.0B parameters (the published 27B; the vision tower is not counted)."""
    shape = model_shapes.resolve("shape:Gemma-3-27B")
    assert abs(shape.params - 27.0e9) / 27.0e9 < 0.01
    config = ModelConfig.from_hf(shape.config)
    assert config.layer_types.count("full_attention") == 10 and config.sliding_window == 1024
    assert config.query_pre_attn_scalar == 168 and config.rope_local_base_freq == 1e4
    assert dict(config.rope_scaling) == {"rope_type": "linear", "factor": 8.0}
