"""Model TFLOP/s with and without attention FLOPs: the figures of a real run's metrics checked by hand."""
from __future__ import annotations

import json
import os

import pytest

from megatrain.planner import model_shapes
from megatrain.tools import metrics, progress, train

TINY = dict(model_type="llama", vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def test_attention_flops_per_token_by_hand() -> None:
    shape = model_shapes.from_config(TINY)
    # QK^T and PV: 2 x 2 x heads x head_dim per key seen, (S + 1) / 2 keys on average (causal); backward 2.5 x.
    heads, head_dim, layers, seq = 4, 8, 2, 32
    fwd = 2 * 2 * heads * head_dim * (seq + 1) / 2
    assert shape.attention_model_flops_per_token(seq) == pytest.approx(layers * (fwd + 2.5 * fwd))


def test_metrics_give_tflops_with_and_without_attention(tmp_path, capsys) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    out = str(tmp_path / "run")
    seq = 32
    assert train.main(["--model", str(config), "--steps", "3", "--out", out, "--seq-len", str(seq), "--batch", "2",
                       "--progress", "plain", "--log-every", "1", "--no-plot"]) == 0
    # Parameters by hand: embedding, per layer q, k, v, o, gate, up, down and two norms, final norm, lm_head.
    h, i, v, kv = 32, 64, 512, 2 * 8
    n = v * h + 2 * (h * h + 2 * h * kv + h * h + 3 * h * i + 2 * h) + h + v * h
    attention = 2 * 3.5 * (2 * 2 * 4 * 8 * (seq + 1) / 2)  # layers x (forward + 2.5 x forward), per token
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 3
    for r in records:
        tps = r["step_tokens"] / r["step_time_s"]
        assert r["tokens_per_second"] == pytest.approx(tps)
        assert r["model_tflops"] == pytest.approx(6 * n * tps / 1e12)
        assert r["model_tflops_with_attention"] == pytest.approx((6 * n + attention) * tps / 1e12)
        assert r["model_tflops_with_attention"] > r["model_tflops"]
        if r["mfu"] is not None:  # a measured peak on this machine
            assert r["mfu_with_attention"] / r["mfu"] == pytest.approx((6 * n + attention) / (6 * n))
        else:
            assert r["mfu_with_attention"] is None
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["num_parameters"] == n
    assert summary["model_flops_per_token"] == 6 * n
    assert summary["attention_flops_per_token"] == pytest.approx(attention)
    ratio = summary["model_tflops_with_attention"] / summary["model_tflops"]
    assert ratio == pytest.approx((6 * n + attention) / (6 * n))
    err = capsys.readouterr().err
    assert "model TFLOP/s (6N, attention not counted" in err and "model TFLOP/s with attention" in err


def test_progress_line_names_both_figures() -> None:
    flops = metrics.TokenFlops(model=600.0, attention=150.0, seq=16)
    record = {"loss": 1.0, "tokens_per_second": 1e9, "lr": 1e-3, "host_memory_bytes": 0,
              **flops.figures(1e9, peak_tflops=1.0)}
    assert record["model_tflops"] == pytest.approx(0.6) and record["mfu_with_attention"] == pytest.approx(0.75)
    line = progress.describe(record)
    assert "MFU 60.0% (6N), 75.0% with attention" in line
    line = progress.describe({**record, **flops.figures(1e9, peak_tflops=None)})
    assert "0.6 TFLOP/s (6N), 0.75 with attention" in line
