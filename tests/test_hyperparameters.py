"""Non-finite or out-of-range hyper-parameters are refused where they enter, with one line naming the field."""
from __future__ import annotations

import math

import pytest
import torch

from megatrain.runtime import ConfigError, Engine, InputError, MegatrainError, ModelConfig, OptimizerConfig

BASE = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2)
NAN, INF = float("nan"), float("inf")


def _one_line(err, word: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg and word in msg, msg


@pytest.mark.parametrize("lr", [NAN, INF, -INF, -1e-3, "3e-4", True, 1e308, 1.5])
def test_step_refuses_bad_lr_and_changes_nothing(lr) -> None:
    with Engine(ModelConfig(**BASE), compute_dtype=torch.float32, device="cpu") as engine:
        ids = torch.randint(0, 32, (2, 8))
        before = engine.state_dict()
        with pytest.raises(InputError) as err:
            engine.step(ids, ids, lr=lr)
        _one_line(err, "lr=")
        assert engine.step_count == 0
        after = engine.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        engine.step(ids, ids, lr=0.0)  # still trains; lr=0 leaves weights finite
        assert all(bool(torch.isfinite(t).all()) for t in engine.state_dict().values())


@pytest.mark.parametrize("field, value", [
    ("lr", NAN), ("lr", INF), ("lr", -1.0), ("lr", "1e-3"), ("lr", None),
    ("betas", None), ("betas", (0.9,)), ("betas", (1.0, 0.999)), ("betas", (0.9, NAN)), ("betas", (-0.1, 0.9)),
    ("betas", "ab"), ("betas", (0.9, INF)),
    ("eps", 0.0), ("eps", -1e-8), ("eps", INF), ("eps", NAN), ("eps", None),
    ("weight_decay", INF), ("weight_decay", NAN), ("weight_decay", -0.1), ("weight_decay", "0.1"),
    ("max_grad_norm", INF), ("max_grad_norm", NAN), ("max_grad_norm", 0.0), ("max_grad_norm", "1"),
    ("lr", 1e308), ("lr", 1.5), ("weight_decay", 1e308), ("weight_decay", 11.0), ("eps", 1e308), ("eps", 2.0),
    ("no_decay", [1, 2]), ("no_decay", 3),
])
def test_optimizer_config_refuses(field, value) -> None:
    with pytest.raises(ConfigError) as err:
        OptimizerConfig(**{field: value})
    _one_line(err, f"{field}=")


@pytest.mark.parametrize("field, value", [
    ("rope_theta", INF), ("rope_theta", NAN), ("rope_theta", 0.0), ("rope_theta", "1e4"), ("rope_theta", None),
    ("sliding_window", 0), ("sliding_window", -4), ("sliding_window", 8.0),
    ("rms_norm_eps", None), ("rms_norm_eps", "1e-6"), ("rms_norm_eps", INF), ("rms_norm_eps", 0.0),
    ("initializer_range", NAN), ("initializer_range", -0.02), ("initializer_range", INF),
    ("vocab_size", True), ("hidden_size", 16.0), ("num_key_value_heads", True), ("num_key_value_heads", 0),
    ("head_dim", 8.0), ("max_position_embeddings", 0), ("pad_token_id", "0"),
    ("tie_word_embeddings", "yes"), ("attention_bias", 1), ("qk_norm", None), ("o_proj_bias", "no"),
    ("model_type", ["llama"]), ("rope_scaling", "linear"),
])
def test_model_config_refuses(field, value) -> None:
    with pytest.raises(ConfigError) as err:
        ModelConfig(**{**BASE, field: value})
    _one_line(err, f"{field}=")


@pytest.mark.parametrize("scaling, word", [
    ({"rope_type": "linear", "factor": INF}, "factor"),
    ({"rope_type": "linear", "factor": "2"}, "factor"),
    ({"rope_type": "linear", "factor": 0}, "factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 8192}, "high_freq_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 0.5}, "original_max_position_embeddings"),
])
def test_rope_scaling_numbers_refused(scaling, word) -> None:
    with pytest.raises(MegatrainError) as err:
        ModelConfig(**BASE, rope_scaling=scaling)
    _one_line(err, word)


def test_valid_values_still_accepted() -> None:
    opt = OptimizerConfig(lr=0, betas=[0.0, 0.5], eps=1e-12, weight_decay=0, max_grad_norm=None, no_decay="bias")
    assert opt.betas == (0.0, 0.5) and opt.no_decay == ("bias",)
    cfg = ModelConfig(**BASE, rope_theta=500000, sliding_window=4096, initializer_range=0.0, pad_token_id=99,
                      rope_scaling={"rope_type": "llama3", "factor": 8, "low_freq_factor": 1,
                                    "high_freq_factor": 4, "original_max_position_embeddings": 8192})
    assert cfg.rope_theta == 500000.0 and math.isfinite(cfg.rope_theta) and cfg.pad_token_id is None


@pytest.mark.parametrize("lr, weight_decay", [(0.5, 2.0), (1.0, 1.0), (0.1, 10.0)])
def test_decoupled_decay_that_would_flip_the_weights_is_refused(lr, weight_decay) -> None:
    """Each step scales every weight by 1 - lr x weight_decay: at 1 or more it zeroes or flips them."""
    with pytest.raises(ConfigError, match=r"lr=.* x weight_decay=.* must be < 1"):
        OptimizerConfig(lr=lr, weight_decay=weight_decay)
    with Engine(ModelConfig(**BASE), OptimizerConfig(lr=1e-3, weight_decay=weight_decay),
                compute_dtype=torch.float32, device="cpu") as engine:
        ids = torch.randint(0, 32, (2, 8))
        with pytest.raises(InputError, match="must be < 1"):
            engine.step(ids, ids, lr=lr)  # a step's own lr too
        assert engine.step_count == 0


def test_the_largest_values_a_real_run_uses_are_accepted() -> None:
    OptimizerConfig(lr=1.0, weight_decay=0.0, eps=1.0, betas=(0.0, 0.999999))
    OptimizerConfig(lr=0.09, weight_decay=10.0)
