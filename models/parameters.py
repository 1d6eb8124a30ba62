"""Parameter tables: each block's parameters in order, and their Hugging Face names. Pure stdlib.

A block is the embedding, one decoder layer, or the head (final norm + lm_head; with tied embeddings the head
has only the norm). Names are local to the block and follow Hugging Face transformers; the order is the order
in which transformers' modules register them (so that it matches ``model.parameters()``). The tables here are
the Llama-style decoder's, which most families use as they are (a family with other parameters gives its own
``layer_parameters``): in a decoder layer, the attention (q, k, v, o projections, each weight then its bias,
then the q and k norms when ``qk_norm``), the MLP (gate, up, down), then the two norms.

The runtime's templates lay out each block's flat buffer from a family's table and check at construction that
their modules register exactly these parameters; the planner's model shapes count parameters and bytes from it.
Tables take the model's dimensions by their config.json names (``dims``: a ``ModelConfig.to_dict()``, a
``ModelShape.config_dims()``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

# The kinds of block, by the names the runtime's ``BlockKind`` values carry.
EMBED, LAYER, HEAD = "embed", "layer", "head"


@dataclass(frozen=True)
class Param:
    name: str  # inside the block, e.g. "self_attn.q_proj.weight"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class DiskTensor:
    """One tensor of a Hugging Face checkpoint holding part of a parameter: elements [start, start + numel) of
    it (a family whose files split a parameter, such as per-expert tensors of fused experts, names several)."""

    name: str
    shape: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def embedding_parameters(*, vocab_size: int, hidden_size: int) -> tuple[Param, ...]:
    return (Param("embed_tokens.weight", (vocab_size, hidden_size)),)


def layer_parameters(*, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int,
                     head_dim: int, attention_bias: bool, o_proj_bias: bool, mlp_bias: bool,
                     qk_norm: bool) -> tuple[Param, ...]:
    """One Llama-style decoder layer. q width = heads x head_dim, k/v width = kv heads x head_dim."""
    h, i = hidden_size, intermediate_size
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    p: list[Param] = []
    p += linear("self_attn.q_proj", h, q, attention_bias)
    p += linear("self_attn.k_proj", h, kv, attention_bias)
    p += linear("self_attn.v_proj", h, kv, attention_bias)
    p += linear("self_attn.o_proj", q, h, o_proj_bias)
    if qk_norm:
        p += [Param("self_attn.q_norm.weight", (head_dim,)), Param("self_attn.k_norm.weight", (head_dim,))]
    p += linear("mlp.gate_proj", h, i, mlp_bias)
    p += linear("mlp.up_proj", h, i, mlp_bias)
    p += linear("mlp.down_proj", i, h, mlp_bias)
    p += [Param("input_layernorm.weight", (h,)), Param("post_attention_layernorm.weight", (h,))]
    return tuple(p)


def head_parameters(*, hidden_size: int, vocab_size: int, tie_word_embeddings: bool) -> tuple[Param, ...]:
    """Final norm, and lm_head unless it is the embedding's weight."""
    norm = Param("norm.weight", (hidden_size,))
    return (norm,) if tie_word_embeddings else (norm, Param("lm_head.weight", (vocab_size, hidden_size)))


def linear(name: str, n_in: int, n_out: int, bias: bool) -> list[Param]:
    """An ``nn.Linear``'s parameters as torch registers them: weight [out, in], then its bias."""
    return [Param(f"{name}.weight", (n_out, n_in))] + ([Param(f"{name}.bias", (n_out,))] if bias else [])


def head_dim(dims: Mapping[str, Any]) -> int:
    """The per-head width: ``head_dim``, or hidden_size / heads when unset."""
    return dims.get("head_dim") or dims["hidden_size"] // dims["num_attention_heads"]


def llama_embedding(dims: Mapping[str, Any]) -> tuple[Param, ...]:
    return embedding_parameters(vocab_size=dims["vocab_size"], hidden_size=dims["hidden_size"])


def llama_layer(dims: Mapping[str, Any]) -> tuple[Param, ...]:
    heads = dims["num_attention_heads"]
    attention_bias = bool(dims.get("attention_bias"))
    o_proj_bias = dims.get("o_proj_bias")
    return layer_parameters(
        hidden_size=dims["hidden_size"], intermediate_size=dims["intermediate_size"], num_heads=heads,
        num_kv_heads=dims.get("num_key_value_heads") or heads, head_dim=head_dim(dims),
        attention_bias=attention_bias, o_proj_bias=attention_bias if o_proj_bias is None else bool(o_proj_bias),
        mlp_bias=bool(dims.get("mlp_bias")), qk_norm=bool(dims.get("qk_norm")))


def llama_head(dims: Mapping[str, Any]) -> tuple[Param, ...]:
    return head_parameters(hidden_size=dims["hidden_size"], vocab_size=dims["vocab_size"],
                           tie_word_embeddings=bool(dims.get("tie_word_embeddings")))


def llama_hf_name(kind: str, layer: int | None, local_name: str) -> str:
    """The Hugging Face state-dict name of a block's parameter: ``model.layers.3.mlp.up_proj.weight``."""
    if kind == LAYER:
        return f"model.layers.{layer}.{local_name}"
    return local_name if local_name.startswith("lm_head.") else f"model.{local_name}"
