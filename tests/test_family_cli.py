"""``megatrain-train --model DIR`` on directories transformers wrote for the families beyond Llama / Qwen2 / Qwen3 /
Mistral (those: test_train.py), dense and mixture-of-experts: two steps, then the run's export loads in transformers
as the same architecture (with the same layer types) and with every weight trained (chat fine-tuning of a Qwen3-MoE
with its load-balancing loss: test_moe_training_cli.py)."""
from __future__ import annotations

import pytest
import torch

from megatrain.tools import export

from chat_model import train_two_steps, write_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=0,
             eos_token_id=2, pad_token_id=None)
# Gemma 3 and gpt-oss: sliding layers of window 8 under the 32-token rows, every second layer global.
# The mixtures of experts: 4 experts, 2 a token (Qwen2-MoE with its shared expert).
EXTRA = {"phi3": {}, "olmo2": {},
         "gemma3_text": dict(sliding_window=8, sliding_window_pattern=2, final_logit_softcapping=30.0),
         "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
         "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48),
         "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
         "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=8)}


@pytest.mark.parametrize("model_type", sorted(EXTRA))
def test_train_cli_trains_and_exports_the_family(tmp_path, model_type: str) -> None:
    model = write_tokenizer(str(tmp_path / "model"))
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **{**SHAPE, **EXTRA[model_type]})
    saved = transformers.AutoModelForCausalLM.from_config(config)
    saved.save_pretrained(model)
    run = tmp_path / "run"
    train_two_steps(model, str(tmp_path), str(run))
    assert export.main([str(run), str(tmp_path / "exported"), "--dtype", "fp32"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert type(loaded) is type(saved)
    assert getattr(loaded.config, "layer_types", None) == getattr(config, "layer_types", None)
    trained = dict(loaded.named_parameters())
    assert sorted(trained) == sorted(n for n, _ in saved.named_parameters())
    for name, p in saved.named_parameters():  # AdamW moves every weight (its decay alone moves an unused one)
        assert trained[name].shape == p.shape and not torch.equal(trained[name], p), name
