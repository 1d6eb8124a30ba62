"""A dense family is one folder: a toy family registered here alone, with no product file touched, trains through
``megatrain.runtime.Engine`` exactly as a hand-written plain-PyTorch model does.

The toy is a Llama with one change: its MLP is not gated, down(gelu(up(x))) (no gate_proj). It brings what a
family folder would: config rules and a parameter table (stdlib: ``FAMILY``), and blocks (torch: the shared
decoder skeleton with its own MLP; ``FAMILY.blocks`` names this module). The reference below is written from
scratch in plain PyTorch (no megatrain layer) with Hugging Face names, so the Engine loads its weights; both
train a few fp32 AdamW steps with clipping, and the losses and weights agree within float32 noise.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_reference import batch
from megatrain.models import registry
from megatrain.models.config_fields import attention_biases, fixed_flag
from megatrain.models.family import Family
from megatrain.models.layers.decoder import DecoderLayer as LlamaDecoderLayer
from megatrain.models.layers.decoder import EmbeddingBlock, HeadBlock  # noqa: F401 (the toy's blocks, as they are)
from megatrain.models.parameters import Param, llama_layer
from megatrain.planner.shapes import model_shapes
from megatrain.runtime import ConfigError, Engine, ModelConfig, OptimizerConfig, Plan
from numerics import assert_update_close

MODEL_TYPE = "toy_gelu_mlp"


# ---- the toy family's stdlib half: config rules and parameter table -----------------------------------------

def read(data: Mapping[str, Any], num_hidden_layers: int) -> dict[str, Any]:
    return {**attention_biases(MODEL_TYPE, data, mlp=False), "qk_norm": fixed_flag(MODEL_TYPE, data, "qk_norm", False),
            "sliding_window": None}


def layer(dims: Mapping[str, Any]) -> tuple[Param, ...]:
    """Llama's layer without mlp.gate_proj."""
    return tuple(p for p in llama_layer(dims) if not p.name.startswith("mlp.gate_proj."))


FAMILY = Family(model_type=MODEL_TYPE, architecture="ToyForCausalLM", read=read,
                write=lambda config: {"attention_bias": config.attention_bias}, layer=layer, blocks=__name__)


# ---- the toy family's torch half: its blocks ---------------------------------------------------------------

class GeluMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any) -> None:
        super().__init__(config, mlp=GeluMLP)


@pytest.fixture
def toy() -> Iterator[Family]:
    registry.register(FAMILY)
    try:
        yield FAMILY
    finally:
        registry.unregister(MODEL_TYPE)


# ---- the reference: plain PyTorch, written from scratch ------------------------------------------------------

HF = dict(model_type=MODEL_TYPE, vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
          max_position_embeddings=64, attention_bias=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RefLayer(nn.Module):
    def __init__(self, h: int, i: int, heads: int, kv: int) -> None:
        super().__init__()
        d = h // heads
        self.heads, self.kv, self.d = heads, kv, d
        self.self_attn = nn.ModuleDict({"q_proj": nn.Linear(h, heads * d), "k_proj": nn.Linear(h, kv * d),
                                        "v_proj": nn.Linear(h, kv * d), "o_proj": nn.Linear(heads * d, h)})
        self.mlp = nn.ModuleDict({"up_proj": nn.Linear(h, i, bias=False), "down_proj": nn.Linear(i, h, bias=False)})
        self.input_layernorm = nn.Parameter(1.0 + 0.1 * torch.randn(h))
        self.post_attention_layernorm = nn.Parameter(1.0 + 0.1 * torch.randn(h))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        a = self.self_attn
        n = rms_norm(x, self.input_layernorm, HF["rms_norm_eps"])
        q = a["q_proj"](n).view(b, s, self.heads, self.d).transpose(1, 2)
        k = a["k_proj"](n).view(b, s, self.kv, self.d).transpose(1, 2)
        v = a["v_proj"](n).view(b, s, self.kv, self.d).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = (t.repeat_interleave(self.heads // self.kv, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + a["o_proj"](out)
        n = rms_norm(x, self.post_attention_layernorm, HF["rms_norm_eps"])
        return x + self.mlp["down_proj"](F.gelu(self.mlp["up_proj"](n)))


class Reference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        h, i, v = HF["hidden_size"], HF["intermediate_size"], HF["vocab_size"]
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(v, h)
        self.model.layers = nn.ModuleList(RefLayer(h, i, HF["num_attention_heads"], HF["num_key_value_heads"])
                                          for _ in range(HF["num_hidden_layers"]))
        self.model.norm = nn.Parameter(1.0 + 0.1 * torch.randn(h))
        self.lm_head = nn.Linear(h, v, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        d = HF["hidden_size"] // HF["num_attention_heads"]
        inv = 1.0 / HF["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        angles = torch.arange(ids.shape[1], dtype=torch.float32)[:, None] * inv[None]
        angles = torch.cat((angles, angles), dim=-1)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, angles.cos(), angles.sin())
        return self.lm_head(rms_norm(x, self.model.norm, HF["rms_norm_eps"]))

    def hf_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters by their Hugging Face names (a norm's weight is ``<norm>.weight``)."""
        return {f"{n}.weight" if n.endswith(("layernorm", "model.norm")) else n: p for n, p in self.named_parameters()}


# ---- the test ---------------------------------------------------------------------------------------------------

def test_the_toy_family_trains_through_the_engine_like_plain_pytorch(toy: Family) -> None:
    torch.manual_seed(0)
    ref = Reference()
    config = ModelConfig.from_hf(HF)
    assert config.model_type == MODEL_TYPE and config.attention_bias and not config.mlp_bias
    shape = model_shapes.from_config(HF)
    assert shape.params == sum(p.numel() for p in ref.parameters())  # the planner counts the toy's table
    h, i, q, kv = 32, 48, 4 * 8, 2 * 8
    assert shape.matmul_weights_layer == h * q + 2 * h * kv + q * h + 2 * h * i  # two MLP matrices, not three

    optimizer = OptimizerConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
    named = ref.hf_parameters()
    initial = {n: p.detach().clone() for n, p in named.items()}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=optimizer.lr, betas=optimizer.betas, eps=optimizer.eps,
                                weight_decay=optimizer.weight_decay)
    with Engine(config, optimizer, plan=Plan(micro_batch_size=1, loss_chunk_tokens=16), compute_dtype=torch.float32,
                device="cpu") as engine:
        assert sorted(engine.state_dict()) == sorted(initial)  # no gate_proj: the toy's table, not Llama's
        engine.load_state_dict(initial)
        for step in range(3):
            ids, labels = batch(HF["vocab_size"], seed=step)
            logits = ref(ids)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), optimizer.max_grad_norm)
            ref_opt.step()
            ref_opt.zero_grad()
            ours = engine.step(ids, labels).item()
            assert abs(ours - loss.item()) <= 1e-5, (step, ours, loss.item())
        trained = engine.state_dict()
    assert_update_close(trained, {n: p.detach() for n, p in named.items()}, initial)


def test_an_unregistered_family_is_refused() -> None:
    with pytest.raises(ConfigError, match=f"model_type='{MODEL_TYPE}' is not supported"):
        ModelConfig.from_hf(HF)
