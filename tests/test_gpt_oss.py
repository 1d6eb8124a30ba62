"""gpt-oss against transformers 5's ``GptOssForCausalLM``: attention sinks (against transformers' own
``eager_attention_forward``, with windows and grouped heads), a model ``save_pretrained`` wrote loads, trains 3 fp32
AdamW steps with clipping equal to transformers under ``torch.optim.AdamW`` (YaRN RoPE, biased router, clamped
SwiGLU; an expert the router's bias starves: zero gradient, decayed all the same), within packed documents and
under sequence tiles, and exports back; an MXFP4 checkpoint with known values dequantizes on load as transformers'
``convert_moe_packed_tensors``; the presets' published sizes (``megatrain-train --model DIR``: test_family_cli.py);
``megatrain-plan size --hardware H200`` answers with host RAM and NVMe.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

from hf_reference import (assert_packed_documents_match_transformers, assert_saved_trains_and_exports, batch,  # noqa: E402
                          randomize_norms_and_biases)
from megatrain.models.layers.attention import Documents, sink_attention  # noqa: E402
from megatrain.planner.shapes import model_shapes  # noqa: E402
from megatrain.runtime import Engine, ModelConfig, Plan  # noqa: E402
from megatrain.runtime.errors import ConfigError  # noqa: E402
from megatrain.runtime.io import mxfp4  # noqa: E402
from test_families import TINY  # noqa: E402

from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward  # noqa: E402

# 4 experts of width 16, 2 per token; sliding and full layers alternating, the window (5) under a row's 20 tokens.
SHAPE = {**TINY, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 16, "sliding_window": 5,
         "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}


def _hf_model(**extra):
    torch.manual_seed(7)
    config = transformers.AutoConfig.for_model("gpt_oss", **{**SHAPE, **extra})
    model = transformers.GptOssForCausalLM(config).float()
    model.set_experts_implementation("eager")  # GptOssExperts' own loop: the reference
    randomize_norms_and_biases(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()  # sinks that matter (transformers' init: std 0.02)
    return config, model


def _eager(q, k, v, sinks, window):
    """transformers' eager attention with its sinks, under its causal (sliding) mask."""
    s = q.shape[2]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j <= i) & ((i - j < window) if window else True)
    mask = torch.zeros(s, s, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups = sinks, q.shape[1] // k.shape[1]
    out, _ = eager_attention_forward(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)


@pytest.mark.parametrize("window", [None, 4, 13])
def test_sink_attention_matches_transformers_eager(window) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 13, 12, generator=gen, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    ours = sink_attention(q, k, v, sinks, scale=12 ** -0.5, window=window)
    theirs = _eager(q, k, v, sinks, window)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    g = torch.randn(ours.shape, generator=gen, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((ours * g).sum(), (q, k, v, sinks)),
                    torch.autograd.grad((theirs * g).sum(), (q, k, v, sinks))):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # Packed documents: each its own sequence, with the sink.
    lengths = [[5, 3, 5], [9, 4]]
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    packed = sink_attention(q, k, v, sinks, scale=12 ** -0.5, window=window,
                            documents=Documents.from_position_ids(positions))
    for r, row in enumerate(lengths):
        start = 0
        for n in row:
            part = slice(start, start + n)
            alone = _eager(q[r:r + 1, :, part], k[r:r + 1, :, part], v[r:r + 1, :, part], sinks, window)
            torch.testing.assert_close(packed[r:r + 1, :, part], alone, rtol=0, atol=1e-12)
            start += n


def test_saved_by_transformers_trains_like_transformers_and_exports(tmp_path) -> None:
    config, hf = _hf_model()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.router.bias[-1] = -100.0  # the last expert is never among a token's top 2
    hf.save_pretrained(tmp_path / "hf")
    ids, labels = batch(config.vocab_size)
    hf(ids, labels=labels).loss.backward()
    experts = hf.model.layers[0].mlp.experts
    for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
        assert not getattr(experts, name).grad[-1].any(), name  # the starved expert: no gradient in transformers
    hf.zero_grad()
    starved = experts.down_proj[-1].detach().clone()

    mt_config = ModelConfig.from_hf(tmp_path / "hf")
    assert mt_config.layer_types == ("sliding_attention", "full_attention") and mt_config.sliding_window == 5
    assert mt_config.rope_scaling["rope_type"] == "yarn"
    assert (mt_config.num_experts, mt_config.moe_intermediate_size) == (4, 16)
    with Engine.from_pretrained(tmp_path / "hf", compute_dtype=torch.float32, device="cpu") as engine:
        engine.step(ids, labels)
        counts = engine.routing.tokens.cpu()  # [layers, experts]: the router reports the experts it chose
    assert counts.shape == (config.num_hidden_layers, 4)
    assert (counts.sum(dim=1) == ids.numel() * config.num_experts_per_tok).all()
    assert not counts[:, -1].any(), "the starved expert receives no token"

    assert_saved_trains_and_exports(tmp_path / "hf", hf, tmp_path / "out")
    decay = (1 - 1e-3 * 0.1) ** 3  # hf_reference's lr and weight decay: AdamW decays the expert all the same
    torch.testing.assert_close(experts.down_proj[-1].detach(), starved * decay)


def test_packed_documents_and_sequence_tiles() -> None:
    config, hf = _hf_model()
    lengths = [[13, 7], [4, 16]]
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (2, 20), generator=gen)
    assert_packed_documents_match_transformers(hf, ModelConfig.from_hf(config.to_dict()), ids, lengths)
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    ids, labels = batch(config.vocab_size, rows=2)
    runs = []
    for plan in (Plan(micro_batch_size=1), Plan(micro_batch_size=1, mlp_tile_tokens=3, attention_tile_tokens=7)):
        with Engine(ModelConfig.from_hf(config.to_dict()), plan=plan, compute_dtype=torch.float32, device="cpu",
                    seed=1) as engine:
            engine.load_state_dict(hf.state_dict())
            runs.append(([engine.step(ids, labels, position_ids=positions).item() for _ in range(2)],
                         engine.state_dict()))
    (plain, plain_state), (tiled, tiled_state) = runs
    assert plain == pytest.approx(tiled, abs=1e-6)
    for name, tensor in plain_state.items():
        torch.testing.assert_close(tiled_state[name], tensor, rtol=0, atol=1e-5)


def _pack(codes: torch.Tensor, exponents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [E, C, R] given as FP4 codes [E, C, R] and each group's exponent [E, C / 32, R] -> MXFP4 blocks
    [E, R, C / 32, 16] and scales [E, R, C / 32] (element 2j in a byte's low nibble, 2j + 1 in its high one)."""
    e, c, r = codes.shape
    rows = codes.permute(0, 2, 1).reshape(e, r, c // 32, 16, 2)
    blocks = (rows[..., 0] | (rows[..., 1] << 4)).to(torch.uint8)
    return blocks.contiguous(), (exponents.permute(0, 2, 1) + 127).to(torch.uint8).contiguous()


def _write_mxfp4(path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A gpt-oss directory whose experts are MXFP4 with known values: transformers' model (its other weights) and
    the experts' values."""
    config, hf = _hf_model(intermediate_size=32, quantization_config={"quant_method": "mxfp4"})
    tensors = {n: p.detach().contiguous() for n, p in hf.named_parameters()}
    expected, gen = {}, torch.Generator().manual_seed(5)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, c, r = tensors.pop(name).shape
        codes = torch.randint(0, 16, (e, c, r), generator=gen)
        exponents = torch.randint(-6, 7, (e, c // 32, r), generator=gen)
        if name.endswith("layers.0.mlp.experts.gate_up_proj"):  # by hand: 0b0111 is 6.0, 0b1001 is -0.5
            codes[0, 0, 0], exponents[0, 0, 0], codes[1, 31, 2], exponents[1, 0, 2] = 0b0111, 1, 0b1001, -2
        values = torch.tensor(mxfp4.FP4_VALUES, dtype=torch.float64)[codes]
        expected[name] = (values * 2.0 ** exponents.repeat_interleave(32, dim=1).double()).float()
        tensors[name + "_blocks"], tensors[name + "_scales"] = _pack(codes, exponents)
        assert torch.equal(convert_moe_packed_tensors(tensors[name + "_blocks"], tensors[name + "_scales"],
                                                      dtype=torch.float32), expected[name])
    gate_up = expected["model.layers.0.mlp.experts.gate_up_proj"]
    assert gate_up[0, 0, 0] == 12.0 and gate_up[1, 31, 2] == -0.125
    (path / "config.json").write_text(json.dumps(config.to_dict()))
    safetensors.save_file(tensors, str(path / "model.safetensors"))
    return hf, expected


def test_mxfp4_checkpoint_dequantizes_on_load(tmp_path) -> None:
    hf, expected = _write_mxfp4(tmp_path)
    with Engine.from_pretrained(tmp_path, compute_dtype=torch.float32, device="cpu") as engine:
        loaded = engine.state_dict()
        engine.save_pretrained(tmp_path / "out", dtype=torch.float32)
    for name, p in hf.named_parameters():
        assert torch.equal(loaded[name], expected.get(name, p.detach())), name
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        written = {n: f.get_tensor(n) for n in f.keys()}
    assert all(torch.equal(written[n], loaded[n]) for n in loaded)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    for name, p in plain.named_parameters():
        assert torch.equal(p, loaded[name]), name


def test_mxfp4_loads_as_transformers_loads_it(tmp_path) -> None:
    pytest.importorskip("accelerate")  # transformers' MXFP4 loading needs it (then dequantizes on the CPU)
    _write_mxfp4(tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with Engine.from_pretrained(tmp_path, compute_dtype=torch.float32, device="cpu") as engine:
        ours = engine.state_dict()
    for name, p in theirs.named_parameters():
        assert torch.equal(ours[name], p.detach()), name


def test_config_without_rope_reads_as_transformers_defaults_it() -> None:
    data = {"model_type": "gpt_oss", **{k: SHAPE[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                               "num_hidden_layers", "num_attention_heads")}}
    theirs = transformers.GptOssConfig(**data).rope_parameters
    ours = ModelConfig.from_hf(data)
    assert ours.rope_theta == theirs["rope_theta"] == 150000.0
    assert {**ours.rope_scaling, "rope_theta": ours.rope_theta} == theirs
    assert ours.sliding_window == 128 and ours.num_experts == 128 and ours.num_experts_per_tok == 4


@pytest.mark.parametrize("change, words", [
    ({"swiglu_limit": 10.0}, "swiglu_limit=10.0"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
])
def test_unsupported_configs_are_refused_in_one_line(change: dict, words: str) -> None:
    data = {**_hf_model()[0].to_dict(), **change}
    with pytest.raises(ConfigError, match=words) as err:
        ModelConfig.from_hf(data)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name, total, active", [("gpt-oss-20b", 20.91e9, 3.61e9), ("gpt-oss-120b", 116.83e9, 5.13e9)])
def test_presets_have_the_published_total_and_active_parameters(name: str, total: float, active: float) -> None:
    """OpenAI's model card counts active parameters without the embedding table (a lookup, not a matmul): megatrain's
    N_matmul (``matmul_params_active``, model FLOPs 6 x N_matmul per token); ``params_active`` (the every-parameter
    figure) includes it, as for every family."""
    shape = model_shapes.resolve(f"shape:{name}")
    embedding = shape.vocab_size * shape.hidden_size
    assert abs(shape.params - total) / total < 0.005
    assert abs(shape.params_active - embedding - active) / active < 0.02
    assert abs(shape.matmul_params_active - active) / active < 0.01
    assert shape.model_flops_per_token() == 6.0 * shape.matmul_params_active


def test_plan_size_on_an_h200_answers_with_ram_and_nvme() -> None:
    """The sizing question as a user asks it: no step named, 16 x 4096 tokens by default."""
    r = subprocess.run([sys.executable, "-m", "megatrain.planner.commands.cli", "size", "--model",
                        "shape:gpt-oss-120b", "--hardware", "H200", "--json"], capture_output=True, text=True,
                       timeout=300, env={**os.environ})
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert [e["hardware"] for e in data["hardware"]] == ["H200"]
    h200 = data["hardware"][0]
    assert h200["feasible"] and h200["host_ram_bytes"] > 0 and "nvme_bytes" in h200
    assert data["host_ram_bytes"] > 0 and data["nvme_bytes"] > 0
