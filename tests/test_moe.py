"""Mixture-of-experts families against transformers 5: a model ``save_pretrained`` wrote (per-expert tensors on
disk) loads with ``Engine.from_pretrained`` (and so does one holding the fused in-memory tensors), trains 3 fp32
AdamW steps with clipping equal to transformers' model under ``torch.optim.AdamW`` (an expert no token is routed
to: zero gradient, decayed all the same), and its export loads back in transformers with the same weights.
Config rules: dense layers among sparse ones are refused in one line (the router's load-balancing loss:
test_router_balance.py).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")

from hf_reference import assert_saved_trains_and_exports, batch, randomize_norms_and_biases  # noqa: E402
from megatrain.planner.shapes import model_shapes  # noqa: E402
from megatrain.runtime import Engine, ModelConfig  # noqa: E402
from megatrain.runtime.errors import ConfigError  # noqa: E402
from test_families import MOE, TINY  # noqa: E402

MOE_FAMILIES = tuple(MOE)


def _hf_model(model_type: str, **extra):
    torch.manual_seed(7)
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **MOE[model_type], **extra})
    model = getattr(transformers, type(config).__name__.replace("Config", "ForCausalLM"))(config).float()
    randomize_norms_and_biases(model)
    return config, model


def _starve_last_expert(model: torch.nn.Module) -> None:
    """Route no token to the last expert of any layer: the post-attention norm keeps one channel, on which the
    router's other experts have weights of both signs (two positive, two negative) and the last expert 0."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight.zero_()
            layer.post_attention_layernorm.weight[0] = 1.0
            gate = layer.mlp.gate.weight
            gate.zero_()
            gate[:-1, 0] = torch.tensor([5.0, -5.0, 4.0, -4.0][:gate.shape[0] - 1])


@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_saved_by_transformers_trains_like_transformers_and_exports(tmp_path, model_type: str) -> None:
    config, hf = _hf_model(model_type, num_hidden_layers=2, **({"num_local_experts": 5} if model_type == "mixtral"
                                                               else {"num_experts": 5}))
    _starve_last_expert(hf)
    hf.save_pretrained(tmp_path / "hf")
    ids, labels = batch(config.vocab_size)
    hf(ids, labels=labels).loss.backward()
    for layer in hf.model.layers:  # the starved expert: no gradient in transformers either
        assert not layer.mlp.experts.gate_up_proj.grad[-1].any() and not layer.mlp.experts.down_proj.grad[-1].any()
    hf.zero_grad()
    starved = hf.model.layers[0].mlp.experts.down_proj[-1].detach().clone()

    assert_saved_trains_and_exports(tmp_path / "hf", hf, tmp_path / "out")
    decay = (1 - 1e-3 * 0.1) ** 3  # hf_reference's lr and weight decay: AdamW decays the expert all the same
    torch.testing.assert_close(hf.model.layers[0].mlp.experts.down_proj[-1].detach(), starved * decay)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        written = set(f.keys())
    expert = "block_sparse_moe.experts.0.w1" if model_type == "mixtral" else "mlp.experts.0.gate_proj"
    assert f"model.layers.0.{expert}.weight" in written


def test_fused_expert_tensors_on_disk_load_too(tmp_path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    config, hf = _hf_model("qwen3_moe")
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    safetensors.save_file({n: p.detach().contiguous() for n, p in hf.named_parameters()},
                          str(tmp_path / "model.safetensors"))
    with Engine.from_pretrained(tmp_path, compute_dtype=torch.float32, device="cpu") as engine:
        ours = engine.state_dict()
    for name, p in hf.named_parameters():
        assert torch.equal(ours[name], p.detach()), name


@pytest.mark.parametrize("change, words", [
    ({"mlp_only_layers": [0]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
])
def test_unsupported_layouts_are_refused_in_one_line(change: dict, words: str) -> None:
    data = {**_hf_model("qwen2_moe")[0].to_dict(), **change}
    with pytest.raises(ConfigError, match=words) as err:
        ModelConfig.from_hf(data)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name, total, active", [
    ("shape:Mixtral-8x7B", 46.7e9, 12.9e9), ("shape:Qwen3-30B-A3B", 30.5e9, 3.3e9), ("shape:Qwen3-235B-A22B", 235e9,
     22e9)])
def test_presets_have_the_published_total_and_active_parameters(name: str, total: float, active: float) -> None:
    shape = model_shapes.resolve(name)
    assert abs(shape.params - total) / total < 0.01 and abs(shape.params_active - active) / active < 0.03
    # N_matmul: the active parameters less the embedding (a lookup), the norms and the biases (not matmuls).
    matmul = shape.params_active - shape.params_embedding
    assert 0 < matmul - shape.matmul_params_active < 0.001 * matmul
    assert shape.model_flops_per_token() == 6.0 * shape.matmul_params_active

