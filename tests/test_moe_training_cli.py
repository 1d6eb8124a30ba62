"""``megatrain-train`` on a mixture-of-experts model: chat fine-tuning of a tiny Qwen3-MoE that transformers saved
(with its load-balancing loss on) runs end to end, its metrics rows carry the experts' token counts and load
(the counts themselves against transformers' router logits: test_router_balance.py), the progress line and the
summary say how balanced the routing is, and the export loads back in transformers with the loss still on.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from chat_model import RECORDS, write_tokenizer  # noqa: E402
from megatrain.tools import metrics_routing, progress, train  # noqa: E402


def _qwen3_moe(directory: str, vocab_size: int) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, max_position_embeddings=128, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=24, norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.01,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=2)
    model = transformers.Qwen3MoeForCausalLM(config)
    model.save_pretrained(directory)
    return model


def test_chat_fine_tuning_a_qwen3_moe_reports_the_experts_load(tmp_path, capsys) -> None:
    model_dir = write_tokenizer(str(tmp_path / "model"))
    _qwen3_moe(model_dir, vocab_size=300)
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS * 8) + "\n")
    out, export = tmp_path / "run", tmp_path / "export"
    argv = ["--model", model_dir, "--data", str(data), "--out", str(out), "--seq-len", "64", "--batch", "2",
            "--steps", "3", "--progress", "plain", "--log-every", "1", "--no-plot", "--warmup-steps", "1",
            "--compute-dtype", "fp32", "--no-shuffle", "--export-on-finish", str(export), "--export-dtype", "fp32"]
    assert train.main(argv) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "load " in err and "idle " in err and "aux " in err and "routing      step 3" in err, err

    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # each of the 2 layers routes each real token of the 2 x 64 positions to 2 experts (padding
        # left out: the exact count in test_moe_counters.py)
        assert len(r["expert_tokens"]) == 6 and sum(r["expert_tokens"]) <= 2 * 2 * 64 * 2
        assert sum(r["expert_tokens"]) % (2 * 2) == 0 and r["train_objective"] > r["loss"]
        assert len(r["expert_load"]) == 2 and r["expert_load_max"] == max(r["expert_load"]) >= 1.0
        assert 0.0 <= r["experts_idle"] < 1.0 and r["aux_loss"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["routing"]["step"] == 3 and summary["routing"]["aux_loss"] == rows[-1]["aux_loss"]

    back = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    assert back.config.output_router_logits and back.config.router_aux_loss_coef == 0.01


def test_the_routing_figures_of_a_collapsed_and_a_balanced_router() -> None:
    collapsed = metrics_routing.load_figures([[8, 8, 0, 0], [4, 4, 4, 4]])
    assert collapsed == {"expert_tokens": [12, 12, 4, 4], "expert_load": [2.0, 1.0], "expert_load_max": 2.0,
                         "experts_idle": 0.25}
    line = progress.describe({"loss": 1.0, "tokens_per_second": 1.0, "lr": 1e-3, "host_memory_bytes": 1,
                              **collapsed, "aux_loss": 2.5})
    assert "aux 2.5000  load 2.00x  idle 25%" in line
    assert metrics_routing.progress_part({"loss": 1.0}) is None and metrics_routing.summary([{"step": 1}]) == {}
