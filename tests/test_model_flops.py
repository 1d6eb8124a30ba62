"""The FLOP conventions (benchmarks/README.md, planner/shapes/model_flops.py) checked by hand: model TFLOP/s = 6 x N_matmul
(lm_head in, the input embedding out, a mixture of experts' routed experts only), attention by the model convention
(backward 2x forward), hardware FLOPs apart; and the figures of a real run's metrics."""
from __future__ import annotations

import json
import os

import pytest

from megatrain.planner.shapes import model_shapes
from megatrain.tools import metrics, progress, train

TINY = dict(model_type="llama", vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
# A mixture of experts, top-2 of 4 (Mixtral's layout: a router of 4 x hidden, experts of gate, up and down).
MOE = dict(model_type="mixtral", vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
           max_position_embeddings=64)


def test_matmul_params_dense_by_hand() -> None:
    shape = model_shapes.from_config(TINY)
    h, i, v, kv, layers = 32, 64, 512, 2 * 8, 2
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * i      # q; k, v; o; gate, up, down (norms are not matmuls)
    assert shape.matmul_weights_layer == per_layer
    n_matmul = layers * per_layer + v * h                    # lm_head in; the input embedding (a lookup) out
    assert shape.matmul_params_active == n_matmul
    assert shape.model_flops_per_token() == 6 * n_matmul
    every = v * h + layers * (per_layer + 2 * h) + h + v * h  # the embedding, the norms and lm_head: every parameter
    assert shape.params_active == shape.params == every
    assert shape.all_params_flops_per_token() == 6 * every
    assert shape.summary()["matmul_params_active"] == n_matmul


def test_matmul_params_tied_head_counted_once_as_a_matmul() -> None:
    tied = model_shapes.from_config(dict(TINY, tie_word_embeddings=True))
    untied = model_shapes.from_config(TINY)
    # The tied head's multiply still runs: N_matmul is the same; the distinct parameters lose one vocab x hidden.
    assert tied.matmul_params_active == untied.matmul_params_active
    assert untied.params - tied.params == 512 * 32


def test_matmul_params_moe_top2_of_4_by_hand() -> None:
    shape = model_shapes.from_config(MOE)
    h, moe_i, v, kv, layers, experts, top = 32, 48, 256, 2 * 8, 2, 4, 2
    attention = h * h + 2 * h * kv + h * h                   # q; k, v; o
    router = experts * h
    expert = 3 * h * moe_i                                   # gate, up, down of one expert
    per_layer = attention + router + top * expert            # the two experts a token is routed to
    assert shape.matmul_weights_layer == per_layer
    n_matmul = layers * per_layer + v * h
    assert shape.matmul_params_active == n_matmul == 33_024
    assert shape.model_flops_per_token() == 6 * n_matmul
    every = v * h + layers * (attention + router + experts * expert + 2 * h) + h + v * h
    assert shape.params == every
    active = every - layers * (experts - top) * expert       # the experts not routed to left out
    assert shape.params_active == active and shape.all_params_flops_per_token() == 6 * active
    flops = metrics.TokenFlops.of(MOE, seq=16)
    assert flops.model == 6 * n_matmul and flops.all_params == 6 * active


def test_attention_flops_per_token_by_hand() -> None:
    shape = model_shapes.from_config(TINY)
    # QK^T and PV: 2 x 2 x heads x head_dim per key seen, (S + 1) / 2 keys on average (causal): half of
    # 4 x S x (heads x head_dim) at large S. The model convention counts backward as 2x forward.
    heads, head_dim, layers, seq = 4, 8, 2, 32
    fwd = 2 * 2 * heads * head_dim * (seq + 1) / 2
    assert shape.attention_flops_fwd(seq) == pytest.approx(fwd)
    assert shape.attention_model_flops_per_token(seq) == pytest.approx(layers * (fwd + 2 * fwd))
    # Hardware FLOPs apart: flash attention's real backward, 2.5x forward, what the cost model times.
    assert shape.attention_flops_bwd(seq) == pytest.approx(2.5 * fwd)
    assert shape.attention_hardware_flops_per_token(seq) == pytest.approx(layers * (fwd + 2.5 * fwd))
    # Hardware FLOPs of the step: every layer's forward, recompute and backward, the head's forward and backward.
    h, i, v, kv = 32, 64, 512, 16
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * i
    hardware = layers * (2 * (2 * per_layer + fwd) + 4 * per_layer + 2.5 * fwd) + 6 * v * h
    assert shape.hardware_flops_per_token(seq) == pytest.approx(hardware)


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
    n_matmul = 2 * (h * h + 2 * h * kv + h * h + 3 * h * i) + v * h  # the matmuls: no embedding, no norms
    attention = 2 * 3 * (2 * 2 * 4 * 8 * (seq + 1) / 2)  # layers x (forward + 2 x forward), per token
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 3
    for r in records:
        tps = r["step_tokens"] / r["step_time_s"]
        assert r["tokens_per_second"] == pytest.approx(tps)
        assert r["model_tflops"] == pytest.approx(6 * n_matmul * tps / 1e12)
        assert r["all_params_tflops"] == pytest.approx(6 * n * tps / 1e12)
        assert r["model_tflops_with_attention"] == pytest.approx((6 * n_matmul + attention) * tps / 1e12)
        assert r["model_tflops_with_attention"] > r["model_tflops"]
        if r["mfu"] is not None:  # a measured peak on this machine
            assert r["mfu_with_attention"] / r["mfu"] == pytest.approx((6 * n_matmul + attention) / (6 * n_matmul))
        else:
            assert r["mfu_with_attention"] is None
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["num_parameters"] == n
    assert summary["model_flops_per_token"] == 6 * n_matmul
    assert summary["attention_flops_per_token"] == pytest.approx(attention)
    ratio = summary["model_tflops_with_attention"] / summary["model_tflops"]
    assert ratio == pytest.approx((6 * n_matmul + attention) / (6 * n_matmul))
    err = capsys.readouterr().err
    assert "model TFLOP/s (6 x N_matmul, attention not counted" in err and "model TFLOP/s with attention" in err
    assert f"6 x {n_matmul:,} matmul params" in err


def test_progress_line_names_both_figures() -> None:
    flops = metrics.TokenFlops(model=600.0, attention=150.0, seq=16)
    record = {"loss": 1.0, "tokens_per_second": 1e9, "lr": 1e-3, "host_memory_bytes": 0,
              **flops.figures(1e9, peak_tflops=1.0)}
    assert record["model_tflops"] == pytest.approx(0.6) and record["mfu_with_attention"] == pytest.approx(0.75)
    line = progress.describe(record)
    assert "MFU 60.0% (6 x N_matmul), 75.0% with attention" in line
    line = progress.describe({**record, **flops.figures(1e9, peak_tflops=None)})
    assert "0.6 TFLOP/s (6 x N_matmul), 0.75 with attention" in line
