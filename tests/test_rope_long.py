"""RoPE for long context against transformers: "dynamic" (NTK) and "yarn" beyond max_position_embeddings.

Each type's cos/sin tables (YaRN's attention factor included) equal those of
transformers' rotary embedding module bit for bit at lengths up to 8x the
original context; a tiny Llama with each type gives transformers' logits
(within 1e-5, fp32) on sequences longer than its max_position_embeddings.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain.errors import MegatrainError  # noqa: E402
from megatrain.runtime import Engine, ModelConfig, Plan  # noqa: E402
from megatrain.models.layers.rope import attention_scaling, inverse_frequencies, rotary_tables  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, rms_norm_eps=1e-6)
ROPES = {
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-qwen3": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0},  # original: max_position_embeddings
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                    "beta_fast": 16, "beta_slow": 2, "original_max_position_embeddings": 16},
    "yarn-attn-factor": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "attention_factor": 1.25,
                         "truncate": False, "original_max_position_embeddings": 16},
}


def _hf_config(rope: dict, head_dim: int | None = None):
    extra = {} if head_dim is None else {"head_dim": head_dim}
    return transformers.LlamaConfig(**COMMON, **extra, rope_parameters=dict(rope))


@pytest.mark.parametrize("name", sorted(ROPES))
@pytest.mark.parametrize("seq", [8, 16, 40, 128])
def test_cos_sin_equal_transformers_bitwise(name: str, seq: int) -> None:
    hf_config = _hf_config(ROPES[name], head_dim=64)
    ours = ModelConfig.from_hf(hf_config.to_dict())
    rotary = LlamaRotaryEmbedding(hf_config)  # a fresh module per length: transformers' dynamic RoPE is stateful
    x = torch.zeros(1, seq, 8)
    cos_hf, sin_hf = rotary(x, torch.arange(seq)[None])
    cos, sin = rotary_tables(inverse_frequencies(ours, seq), seq, torch.device("cpu"), attention_scaling(ours))
    assert cos.dtype == torch.float32 and cos.shape == (1, seq, 32)
    assert torch.equal(torch.cat((cos, cos), -1), cos_hf) and torch.equal(torch.cat((sin, sin), -1), sin_hf)
    if name.startswith("yarn"):
        assert attention_scaling(ours) == rotary.attention_scaling != 1.0
    if name == "dynamic" and seq > 16:  # the check can fail: beyond max_position_embeddings the frequencies move
        assert not torch.equal(inverse_frequencies(ours, seq), inverse_frequencies(ours, 16))


@pytest.mark.parametrize("name", ["dynamic", "yarn", "yarn-mscale"])
def test_logits_equal_transformers_beyond_max_position_embeddings(name: str) -> None:
    torch.manual_seed(0)
    hf_config = _hf_config(ROPES[name])
    hf = transformers.LlamaForCausalLM(hf_config).float().eval()
    ids = torch.randint(0, 96, (2, 48))  # 3x max_position_embeddings
    with torch.no_grad():
        expected = hf(ids).logits
    config = ModelConfig.from_hf(hf_config.to_dict())
    with Engine(config, plan=Plan(micro_batch_size=1), compute_dtype=torch.float32, device="cpu") as engine:
        engine.load_state_dict(hf.state_dict())
        got = engine.logits(ids)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        plain = ModelConfig(**{**config.to_dict(), "rope_scaling": None})
    with Engine(plain, plan=Plan(micro_batch_size=1), compute_dtype=torch.float32, device="cpu") as engine:
        engine.load_state_dict(hf.state_dict())  # the check can fail: plain RoPE gives other logits
        assert (engine.logits(ids) - expected).abs().max() > 1e-4


def test_yarn_fields_are_read_and_typed() -> None:
    config = ModelConfig.from_hf(_hf_config(ROPES["yarn-mscale"]).to_dict())
    assert dict(config.rope_scaling) == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                                         "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0}
    assert ModelConfig.from_hf(_hf_config(ROPES["yarn-qwen3"]).to_dict()).rope_scaling[
        "original_max_position_embeddings"] == 16
    with pytest.raises(MegatrainError, match="truncate"):
        ModelConfig.from_hf(dict(COMMON, rope_scaling={"rope_type": "yarn", "factor": 2.0, "truncate": "no"}))
    with pytest.raises(MegatrainError, match="lacks factor"):
        ModelConfig.from_hf(dict(COMMON, rope_scaling={"rope_type": "dynamic"}))
