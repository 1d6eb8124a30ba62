"""megatrain's blocks against Hugging Face transformers, on the same weights.

Random tiny Llama / Qwen2 / Qwen3 / Mistral models are built by transformers,
loaded into megatrain through ``load_state_dict``, and compared: logits and
loss within 1e-5 in float32, then the parameters after a few steps of
megatrain against the transformers model trained by ``torch.optim.AdamW`` with
``clip_grad_norm_`` (bound: ``numerics.assert_update_close``; sources of
difference: transformers' attention kernel and its loss reduction differ in
summation order from megatrain's; the helpers are ``hf_reference``'s). Each supported ``hidden_act`` and the
sliding-window rules are checked the same way.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_reference import assert_matches_transformers, batch, randomize_norms_and_biases  # noqa: E402
from megatrain.runtime import Engine, ModelConfig, Plan  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)

FAMILIES = {
    "llama": lambda tied: transformers.LlamaConfig(**COMMON, tie_word_embeddings=tied, attention_bias=True),
    "llama3-rope": lambda tied: transformers.LlamaConfig(
        **COMMON, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2": lambda tied: transformers.Qwen2Config(**COMMON, tie_word_embeddings=tied),
    "qwen3": lambda tied: transformers.Qwen3Config(**COMMON, tie_word_embeddings=tied, head_dim=12),
    "mistral": lambda tied: transformers.MistralConfig(**COMMON, tie_word_embeddings=tied, sliding_window=None),
}
MODELS = {
    "llama": transformers.LlamaForCausalLM, "llama3-rope": transformers.LlamaForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
    "mistral": transformers.MistralForCausalLM,
}


def _hf_model(family: str, tied: bool, **extra):
    torch.manual_seed(1234)
    config = FAMILIES[family](tied)
    for key, value in extra.items():
        setattr(config, key, value)
    model = MODELS[family](config).float()
    randomize_norms_and_biases(model)
    return config, model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_loss_and_training_match_transformers(family: str, tied: bool) -> None:
    config, hf = _hf_model(family, tied)
    mt_config = ModelConfig.from_hf(config.to_dict())
    assert mt_config.qk_norm == (family == "qwen3")
    assert_matches_transformers(config.vocab_size, hf, mt_config)


# Each activation is told apart from SiLU: on these weights SiLU's logits are off by more than 10x the tolerance.
@pytest.mark.parametrize("family, act", [("llama", "gelu"), ("llama", "relu"), ("qwen2", "gelu_pytorch_tanh"),
                                         ("mistral", "swish"), ("qwen3", "gelu")])
def test_every_hidden_act_matches_transformers(family: str, act: str) -> None:
    config, hf = _hf_model(family, False, hidden_act=act)
    assert config.to_dict()["hidden_act"] == act
    mt_config = ModelConfig.from_hf(config.to_dict())
    assert mt_config.hidden_act == act
    assert_matches_transformers(config.vocab_size, hf, mt_config, steps=2)
    if act != "swish":  # the check can fail: the same weights under SiLU give other logits
        silu = ModelConfig(**{**mt_config.to_dict(), "hidden_act": "silu"})
        with Engine(silu, plan=Plan(micro_batch_size=1), compute_dtype=torch.float32, device="cpu") as engine:
            engine.load_state_dict(hf.state_dict())
            ids, _ = batch(config.vocab_size)
            with torch.no_grad():
                assert (engine.logits(ids) - hf(ids).logits).abs().max() > 1e-4


@pytest.mark.parametrize("family, extra", [
    ("qwen3", dict(use_sliding_window=False, sliding_window=8)),
    ("qwen2", dict(use_sliding_window=False, sliding_window=8)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)),  # no layer slides
])
def test_a_window_transformers_does_not_apply_is_full_attention(family: str, extra: dict) -> None:
    """Sequences of 20 tokens, longer than the window of 8: transformers attends to all of them, and so do we."""
    torch.manual_seed(1234)
    config = (transformers.Qwen3Config if family == "qwen3" else transformers.Qwen2Config)(
        **COMMON, **extra, **({"head_dim": 12} if family == "qwen3" else {}))
    hf = MODELS[family](config).float()
    mt_config = ModelConfig.from_hf(config.to_dict())
    assert mt_config.sliding_window is None
    assert_matches_transformers(config.vocab_size, hf, mt_config, steps=1)


@pytest.mark.parametrize("family, extra", [
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
])
def test_a_window_transformers_applies_matches_it_beyond_the_window(family: str, extra: dict) -> None:
    """Qwen's window on every layer, or on the layers from max_window_layers on (the others full attention),
    over sequences of 20 tokens, longer than the window of 8."""
    torch.manual_seed(1234)
    config = (transformers.Qwen3Config if family == "qwen3" else transformers.Qwen2Config)(
        **COMMON, **extra, **({"head_dim": 12} if family == "qwen3" else {}))
    hf = MODELS[family](config).float()
    mt_config = ModelConfig.from_hf(config.to_dict())
    assert mt_config.sliding_window == 8
    assert mt_config.layer_types == (None if extra["max_window_layers"] == 0 else
                                     ("full_attention",) * 1 + ("sliding_attention",) * (config.num_hidden_layers - 1))
    assert_matches_transformers(config.vocab_size, hf, mt_config, steps=1)


def test_from_hf_reads_both_rope_spellings(tmp_path) -> None:
    old = dict(COMMON, model_type="llama", rope_theta=500000.0,
               rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192})
    new = dict(COMMON, model_type="llama",
               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})
    (tmp_path / "config.json").write_text(__import__("json").dumps(old))
    a, b = ModelConfig.from_hf(tmp_path), ModelConfig.from_hf(new)
    assert a == b
    assert a.rope_theta == 500000.0 and a.rope_scaling["rope_type"] == "llama3"
