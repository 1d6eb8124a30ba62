"""The Llama-style decoder's blocks: architecture only, no weights of their own at run time.

The blocks of every family whose ``blocks`` is this module (``family.LLAMA_BLOCKS``), and the parts a family
with other blocks builds from (``DecoderLayer(config, mlp=...)`` takes another MLP). Each class is
instantiated once on the meta device as a stateless template (the runtime's ``templates.py``); its
parameters are bound per call to views of a device slot. Submodule and parameter names, and their registration order, are those
of Hugging Face transformers (``LlamaDecoderLayer`` and friends), so layout
tables map one-to-one to Hugging Face state-dict names and the parameter order
matches ``model.parameters()``. That order is the family's parameter table
(``megatrain.models.parameters``); ``templates.py`` checks the two agree.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.models.config_fields import SUPPORTED_ACTIVATIONS
from megatrain.models.model_config import ModelConfig
from megatrain.models.layers.attention import Documents, causal_attention
from megatrain.models.layers.rope import apply_rotary

# The MLP's activation by its transformers ACT2FN name, computed as transformers computes it.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,  # exact (erf) GELU
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}
assert set(ACTIVATIONS) == set(SUPPORTED_ACTIVATIONS)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.eps)
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, q, kv = config.hidden_size, config.q_size, config.kv_size
        self.head_dim: int = config.head_dim  # type: ignore[assignment]
        self.n_rep = config.num_attention_heads // config.num_key_value_heads  # type: ignore[operator]
        self.q_proj = nn.Linear(h, q, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, kv, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, kv, bias=config.attention_bias)
        self.o_proj = nn.Linear(q, h, bias=bool(config.o_proj_bias))
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.window = config.sliding_window

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The token-local half before attention: x [B, S, hidden] -> q [B, Hq, S, D], k and v [B, Hkv, S, D],
        q and k rotated (cos, sin: the rows of these tokens)."""
        b, s, _ = x.shape
        shape = (b, s, -1, self.head_dim)
        q = self.q_proj(x).view(shape)
        k = self.k_proj(x).view(shape)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None) -> torch.Tensor:
        """Causal attention over the whole sequence (or within each of ``documents``), each token seeing the last
        ``sliding_window`` positions when the model has one: [B, Hq, S, D]."""
        return causal_attention(q, k, v, scale=self.head_dim ** -0.5, documents=documents, window=self.window)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """o_proj of attention's output [B, Hq, S, D] -> [B, S, hidden]."""
        b, _, s, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        """x: [B, S, hidden] -> [B, S, hidden]; causal over the whole sequence, or within each of ``documents``."""
        return self.output(self.core(*self.project(x, cos, sin), documents))


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.act_fn = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual layer: h = x + attention(norm(x)); out = h + mlp(norm(h)). ``mlp``, ``attention``: their
    classes (a family with others passes its own; the MLP is token-local, so the sequence tiles stay exact). A
    family with other norms overrides ``attention_input``, ``attention_output`` and ``mlp_branch``."""

    def __init__(self, config: ModelConfig, mlp: Callable[[ModelConfig], nn.Module] = MLP,
                 attention: Callable[[ModelConfig], Attention] = Attention) -> None:
        super().__init__()
        self.self_attn = attention(config)
        self.mlp = mlp(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: Documents | None = None,
                mlp_tile_tokens: int = 0, part: str = "layer", attention_tile_tokens: int = 0) -> torch.Tensor:
        """x: [B, S, hidden] (compute dtype) -> same; cos, sin: [1 or B, S, head_dim / 2] (see rope.py);
        ``documents``: packed rows (attention.py), None for whole rows.

        ``mlp_tile_tokens`` > 0: the MLP with its norm runs over sequence tiles of that many tokens (token-local,
        so exact), never holding a [B, S, intermediate] tensor; ``attention_tile_tokens`` > 0: the attention
        half's token-local work (input norm, q/k/v projections and RoPE; o_proj) runs over tiles of that many
        tokens around one attention call over the whole sequence. ``part`` (for a tiled backward,
        ``sequence_tiles.py``): "attention" returns h = x + attention(x); "mlp" takes h and returns the MLP's
        output without the residual; "project" takes x and returns (q, k, v) of its tokens, rotated with the
        cos and sin given (their rows); "core" takes (q, k, v) and returns attention's output over the whole
        sequence; "output" takes attention's output and returns o_proj of it."""
        if part == "mlp":
            return self.mlp_branch(x)
        if part == "project":
            return self.self_attn.project(self.attention_input(x), cos, sin)
        if part == "output":
            return self.attention_output(x)
        if part == "core":
            return self.self_attn.core(*x, documents)
        if 0 < attention_tile_tokens < x.shape[1]:
            h = self._tiled_attention(x, cos, sin, documents, attention_tile_tokens)
        else:
            h = x + self.attention_output(self.self_attn.core(*self.self_attn.project(self.attention_input(x), cos, sin),
                                                              documents))
        if part == "attention":
            return h
        if not 0 < mlp_tile_tokens < h.shape[1]:
            return h + self.mlp_branch(h)
        out = torch.empty_like(h)
        for start in range(0, h.shape[1], mlp_tile_tokens):
            t = h[:, start:start + mlp_tile_tokens]
            out[:, start:start + mlp_tile_tokens] = t + self.mlp_branch(t)
        return out

    def attention_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the attention projects: the input norm of x."""
        return self.input_layernorm(x)

    def attention_output(self, out: torch.Tensor) -> torch.Tensor:
        """What attention's output [B, Hq, S, D] adds to the residual: o_proj of it, [B, S, hidden]."""
        return self.self_attn.output(out)

    def mlp_branch(self, h: torch.Tensor) -> torch.Tensor:
        """What the MLP adds to the residual h: mlp(norm(h))."""
        return self.mlp(self.post_attention_layernorm(h))

    def _tiled_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents: Documents | None,
                         tile: int) -> torch.Tensor:
        """h = x + attention(x) with attention's token-local work in sequence tiles (forward only: no autograd
        graph is kept across tiles; the backward's tiles are in sequence_tiles.py). One whole-sequence tensor
        besides q, k, v and attention's output: h, each tile's o_proj output added into its rows."""
        q, k, v = tile_projections(functools.partial(self._project_rows, x, cos, sin), x.shape[1], tile)
        out = self.self_attn.core(q, k, v, documents)
        del q, k, v
        h = x.clone()
        for start in range(0, x.shape[1], tile):
            h[:, start:start + tile] += self.attention_output(out[:, :, start:start + tile])
        return h

    def _project_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      rows: slice) -> tuple[torch.Tensor, ...]:
        return self.self_attn.project(self.attention_input(x[:, rows]), *rope_rows(cos, sin, rows))


def rope_rows(cos: torch.Tensor, sin: torch.Tensor, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of cos and sin ([1 or B, S, head_dim / 2]) for the tokens ``rows`` of the sequence."""
    return cos[:, rows], sin[:, rows]


def tile_projections(project: Callable[[slice], tuple[torch.Tensor, ...]], seq: int,
                     tile: int) -> tuple[torch.Tensor, ...]:
    """q, k, v of a whole sequence, built tile by tile from ``project(rows)`` (each [B, H, rows, D]) into
    full tensors [B, H, seq, D]."""
    full: tuple[torch.Tensor, ...] = ()
    for start in range(0, seq, tile):
        rows = slice(start, start + tile)
        parts = project(rows)
        if not full:
            full = tuple(p.new_empty(p.shape[0], p.shape[1], seq, p.shape[3]) for p in parts)
        for f, p in zip(full, parts):
            f[:, :, rows] = p
    return full


class EmbeddingBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Built only as a meta-device template: the weights come from the host store, so no init runs (on the meta
        # device, nn.Embedding's normal_ imports torch._dynamo: seconds of CPU in each new process).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, S] int64 -> [B, S, hidden]."""
        return self.embed_tokens(input_ids)


class HeadBlock(nn.Module):
    """Final norm, and lm_head unless the embeddings are tied (then the embedding's weight is used)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, S, hidden] -> normed hidden states; the logits are computed in chunks by the loss."""
        return self.norm(x)
