"""``megatrain-train --model DIR`` on directories transformers wrote for the Phi-3, OLMo 2 and Gemma 3 families: two
steps, then the run's export loads in transformers as the same architecture (Gemma 3 with the same layer types)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatrain.tools import export, train

from chat_model import RECORDS, write_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=0,
             eos_token_id=2, pad_token_id=None)


# Gemma 3: sliding layers of window 8 under the 32-token rows, every second layer global.
EXTRA = {"Gemma3ForCausalLM": dict(sliding_window=8, sliding_window_pattern=2, final_logit_softcapping=30.0)}


@pytest.mark.parametrize("architecture", ["Phi3ForCausalLM", "Olmo2ForCausalLM", "Gemma3ForCausalLM"])
def test_train_cli_trains_and_exports_the_family(tmp_path, architecture: str) -> None:
    model_type = {"Phi3ForCausalLM": "phi3", "Olmo2ForCausalLM": "olmo2", "Gemma3ForCausalLM": "gemma3_text"}[
        architecture]
    model = write_tokenizer(str(tmp_path / "model"))
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **SHAPE, **EXTRA.get(architecture, {}))
    getattr(transformers, architecture)(config).save_pretrained(model)
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS * 4) + "\n")
    run = tmp_path / "run"
    assert train.main(["--model", model, "--tokenizer", os.path.join(model, "tokenizer.json"), "--data", str(data),
                       "--out", str(run), "--seq-len", "32", "--batch", "2", "--steps", "2", "--progress", "none",
                       "--no-plot", "--warmup-steps", "1", "--compute-dtype", "fp32"]) == 0
    assert export.main([str(run), str(tmp_path / "exported"), "--dtype", "fp32"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert type(loaded).__name__ == architecture
    assert getattr(loaded.config, "layer_types", None) == getattr(config, "layer_types", None)
