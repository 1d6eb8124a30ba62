"""Model shapes: parameter counts, bytes and FLOPs against hand computations; config.json parsing."""
from __future__ import annotations

import json

import pytest

from megatrain.planner.shapes import model_shapes as ms
from megatrain.planner.shapes.model_shapes import ModelShapeError


def test_llama_3_1_8b_params_by_hand() -> None:
    m = ms.PRESETS["shape:Llama-3.1-8B"]
    embed = 128256 * 4096                                   # 525,336,576
    q = 4096 * 4096                                         # 32 heads x 128 = 4096 wide
    kv = 4096 * (8 * 128)                                   # 8 kv heads x 128 = 1024 wide
    mlp = 3 * 4096 * 14336                                  # gate, up, down
    norms = 2 * 4096
    layer = q + 2 * kv + q + mlp + norms                    # 218,112,000
    assert embed == 525_336_576 and layer == 218_112_000
    assert m.params_embedding == embed
    assert m.params_layer == layer
    assert m.params_head == 4096 + embed                    # untied: final norm + lm_head
    assert m.params == embed + 32 * layer + 4096 + embed == 8_030_261_248
    # every tensor is a multiple of 64 elements: aligned buffers equal the counts
    assert m.numel_total == m.params
    assert m.numel_largest_block == 4096 + embed
    assert m.block_bytes("bf16") == {"embedding": 2 * embed, "layer": 2 * layer, "head": 2 * (4096 + embed)}


def test_qwen2_5_7b_params_by_hand() -> None:
    m = ms.PRESETS["shape:Qwen2.5-7B"]
    embed = 152064 * 3584                                   # 544,997,376
    q = 3584 * 3584 + 3584                                  # q_proj weight + bias (Qwen2 has qkv bias)
    kv = 3584 * 512 + 512                                   # 4 kv heads x 128 = 512 wide, + bias
    o = 3584 * 3584
    mlp = 3 * 3584 * 18944
    norms = 2 * 3584
    layer = q + 2 * kv + o + mlp + norms
    assert layer == 233_057_792
    assert m.params_layer == layer
    assert m.params == 2 * embed + 28 * layer + 3584 == 7_615_616_512


def test_known_param_counts() -> None:
    published = {"shape:Llama-3.2-1B": 1_235_814_400, "shape:Llama-3.2-3B": 3_212_749_824,
                 "shape:Llama-3.1-70B": 70_553_706_496, "shape:Llama-3.1-405B": 405_853_388_800,
                 "shape:Qwen2.5-0.5B": 494_032_768, "shape:Qwen3-8B": 8_190_735_360, "shape:Mistral-7B": 7_241_732_096}
    for name, n in published.items():
        assert ms.PRESETS[name].params == n, name


def test_flops_by_hand_llama_8b() -> None:
    m = ms.PRESETS["shape:Llama-3.1-8B"]
    seq = 4096
    matmul = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336      # q, o; k, v; gate, up, down
    assert m.matmul_weights_layer == matmul == 218_103_808
    attn_fwd = 2 * 32 * 128 * (seq + 1)                                 # causal: 2 x heads x hd x (S + 1)
    assert m.attention_flops_fwd(seq) == attn_fwd
    assert m.layer_flops_fwd(seq) == 2 * matmul + attn_fwd
    assert m.layer_flops_bwd(seq) == 4 * matmul + 2.5 * attn_fwd
    assert m.layer_flops_recompute(seq) == m.layer_flops_fwd(seq)
    assert m.head_flops_fwd() == 2 * 128256 * 4096
    # N_matmul: the layers' matmul weights and lm_head; the input embedding (a lookup) not counted.
    assert m.matmul_params_active == 32 * matmul + 128256 * 4096 == 7_504_658_432
    assert m.model_flops_per_token() == 6 * 7_504_658_432
    assert m.all_params_flops_per_token() == 6 * 8_030_261_248
    hw_per_token = 32 * (2 * (2 * matmul + attn_fwd) + 4 * matmul + 2.5 * attn_fwd) + 6 * 128256 * 4096
    assert m.hardware_flops_per_token(seq) == pytest.approx(hw_per_token)
    # With recompute the GPU runs ~8N per token against 6N counted (anchors.md): about 4/3, a bit less
    # here because the head (6 x vocab x hidden) is not recomputed.
    assert 1.2 < m.hardware_flops_per_token(1) / m.model_flops_per_token() < 1.34


def test_activation_bytes_qwen_7b() -> None:
    m = ms.PRESETS["shape:Qwen2.5-7B"]
    assert m.checkpoint_bytes_per_token("bf16") == 3584 * 2
    assert m.logits_bytes_per_token("bf16") == 152064 * (2 + 12)
    h, i, q, kv = 3584, 18944, 3584, 512
    saved = 2 * (5 * h + 3 * q + 3 * kv + 4 * i) + 4 * 2 * h + 4 * 28
    transient = 2 * (3 * i + 2 * h)
    assert m.layer_working_bytes_per_token("bf16") == saved + transient


def test_qwen3_head_dim_independent() -> None:
    m = ms.PRESETS["shape:Qwen3-32B"]
    assert m.head_dim == 128 and m.num_heads * m.head_dim == 8192 != m.hidden_size
    # q_proj: 5120 x 8192, k/v: 5120 x 1024, o: 8192 x 5120, q_norm/k_norm: 128 each
    assert m.params_layer == 5120 * 8192 * 2 + 2 * 5120 * 1024 + 3 * 5120 * 25600 + 2 * 5120 + 2 * 128


def test_tied_head_is_only_the_norm() -> None:
    m = ms.PRESETS["shape:Llama-3.2-1B"]
    assert m.tie_word_embeddings
    assert m.params_head == 2048
    assert m.numel_head == 2048
    assert m.numel_largest_block == 128256 * 2048


def test_alignment_pads_each_parameter() -> None:
    m = ms.ModelShape("odd", hidden_size=100, intermediate_size=300, num_layers=2, num_heads=4, num_kv_heads=2,
                      vocab_size=1000)
    assert m.head_dim == 25
    expected = sum(-(-n // 64) * 64 for n in m.layer_params())
    assert m.numel_layer == expected > m.params_layer


def _config(**extra: object) -> dict[str, object]:
    base = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
    base.update(extra)
    return base


LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def test_config_old_rope_spelling() -> None:
    m = ms.from_config(_config(rope_theta=500000.0, rope_scaling={"type": "llama3", **LLAMA3}))
    assert m.rope_theta == 500000.0 and m.rope_scaling == {"rope_type": "llama3", **LLAMA3}


def test_config_new_rope_parameters_spelling() -> None:
    m = ms.from_config(_config(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}))
    assert m.rope_theta == 500000.0
    assert m.rope_scaling == {"rope_type": "llama3", **LLAMA3}
    m = ms.from_config(_config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert m.rope_theta == 1e6 and m.rope_scaling is None


def test_config_qwen_flags() -> None:
    q2 = ms.from_config(_config(model_type="qwen2"))
    assert q2.attention_bias and not q2.qk_norm
    q3 = ms.from_config(_config(model_type="qwen3", head_dim=96, tie_word_embeddings=True))
    assert q3.qk_norm and q3.head_dim == 96 and q3.tie_word_embeddings and not q3.attention_bias


def test_config_file_and_errors(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_config()))
    assert ms.resolve(str(path)).hidden_size == 256
    assert ms.resolve(str(tmp_path)).hidden_size == 256          # a folder holding config.json
    assert ms.resolve("shape:llama-3.1-8b") is ms.PRESETS["shape:Llama-3.1-8B"]
    # A preset's bare name is refused, naming the shape: form: it is a shape with random weights, not the model.
    with pytest.raises(ms.BarePresetName, match="'llama-3.1-8b' is now shape:Llama-3.1-8B .*--model shape:Llama"):
        ms.resolve("llama-3.1-8b")
    assert all(name.startswith("shape:") and shape.name == name for name, shape in ms.PRESETS.items())
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ModelShapeError, match="not valid JSON"):
        ms.resolve(str(bad))
    with pytest.raises(ModelShapeError, match="hidden_size"):
        ms.from_config({"model_type": "llama"})
    with pytest.raises(ModelShapeError, match="valid: shape:Llama-3.2-1B"):
        ms.resolve("GPT-5")
    with pytest.raises(ModelShapeError, match="num_key_value_heads"):
        ms.from_config(_config(num_key_value_heads=3))
    with pytest.raises(ModelShapeError, match="dtype"):
        ms.dtype_bytes("int8")
