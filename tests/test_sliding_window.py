"""Sliding-window attention applied exactly: each token sees only the last ``sliding_window`` positions.

Against transformers on sequences longer than the window (Mistral's window and Phi-3's, both on every layer, and
a Qwen2 whose first layer attends to the whole sequence and whose second slides): logits and three AdamW steps;
each Qwen family's layer types read as transformers reads them; within packed documents (each document alone in
transformers); and under sequence tiles (the attention half's and the MLP's token-local work in tiles) against the
untiled run.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_reference import (assert_matches_transformers, assert_packed_documents_match_transformers, batch,  # noqa: E402
                          randomize_norms_and_biases)
from megatrain.runtime import Engine, ModelConfig, Plan  # noqa: E402

WINDOW = 5
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, sliding_window=WINDOW,
              pad_token_id=None, bos_token_id=None, eos_token_id=None)
ARCHITECTURES = {"mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Qwen2: layers >= max_window_layers slide, so layer 0 is full attention and layer 1 slides.
EXTRA = {"qwen2": dict(use_sliding_window=True, max_window_layers=1)}
LAYER_TYPES = {"mistral": None, "phi3": None, "qwen2": ("full_attention", "sliding_attention")}


def _hf(model_type: str):
    torch.manual_seed(7)
    config = transformers.AutoConfig.for_model(model_type, **COMMON, **EXTRA.get(model_type, {}))
    model = getattr(transformers, ARCHITECTURES[model_type])(config).float()
    randomize_norms_and_biases(model)
    return config, model


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_training_beyond_the_window_matches_transformers(model_type: str) -> None:
    config, hf = _hf(model_type)
    mt_config = ModelConfig.from_hf(config.to_dict())
    assert mt_config.sliding_window == WINDOW and mt_config.layer_types == LAYER_TYPES[model_type]
    assert_matches_transformers(config.vocab_size, hf, mt_config, steps=3)  # 20 tokens a row, window 5


def test_window_applies_within_packed_documents() -> None:
    config, hf = _hf("mistral")
    lengths = [[13, 7], [4, 16]]
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (2, 20), generator=gen)
    assert_packed_documents_match_transformers(hf, ModelConfig.from_hf(config.to_dict()), ids, lengths)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_sequence_tiles_keep_the_window(model_type: str) -> None:
    config, hf = _hf(model_type)
    ids, labels = batch(config.vocab_size)
    runs = []
    for plan in (Plan(micro_batch_size=1), Plan(micro_batch_size=1, mlp_tile_tokens=3, attention_tile_tokens=7)):
        with Engine(ModelConfig.from_hf(config.to_dict()), plan=plan, compute_dtype=torch.float32,
                    device="cpu", seed=1) as engine:
            engine.load_state_dict(hf.state_dict())
            losses = [engine.step(ids, labels).item() for _ in range(2)]
            runs.append((losses, engine.state_dict()))
    (plain, plain_state), (tiled, tiled_state) = runs
    assert plain == pytest.approx(tiled, abs=1e-6)
    for name, tensor in plain_state.items():
        torch.testing.assert_close(tiled_state[name], tensor, rtol=0, atol=1e-5)


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
WINDOW_SETTINGS = [dict(), dict(use_sliding_window=True), dict(use_sliding_window=True, max_window_layers=2),
                   dict(use_sliding_window=True, max_window_layers=0),
                   dict(use_sliding_window=False, max_window_layers=1),
                   dict(use_sliding_window=True, layer_types=["sliding_attention", "full_attention"] * 2)]


@pytest.mark.parametrize("settings", WINDOW_SETTINGS)
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "qwen2_moe", "qwen3_moe"])
def test_qwen_layer_types_read_as_transformers_reads_them(model_type: str, settings: dict) -> None:
    shape = {**COMMON, "num_hidden_layers": 4, **(MOE if model_type.endswith("moe") else {})}
    config = transformers.AutoConfig.for_model(model_type, **shape, **settings)
    ours = ModelConfig.from_hf(config.to_dict())
    if model_type == "qwen3_moe":  # its attention reads no layer_types: the window on every layer, or on none
        theirs = ["sliding_attention" if config.sliding_window else "full_attention"] * 4
    else:
        theirs = config.layer_types
    per_layer = ours.layer_types or ["sliding_attention" if ours.sliding_window else "full_attention"] * 4
    assert list(per_layer) == list(theirs)
    if "sliding_attention" in theirs:
        assert ours.sliding_window == config.sliding_window == WINDOW
