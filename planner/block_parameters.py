"""The parameters of each block, in order: the one table the planner's sizes and the runtime's layout share.

A block is the embedding, one decoder layer, or the head (final norm + lm_head; with tied
embeddings the head has only the norm). Names are local to the block and follow Hugging Face
transformers; the order is the order in which transformers' modules register them (so that
it matches ``model.parameters()``): in a decoder layer, the attention (q, k, v, o projections,
each weight then its bias, then Qwen3's q_norm and k_norm), the MLP (gate, up, down), then the
two norms.

The runtime's templates (``runtime/model/templates.py``) lay out each block's flat buffer from this
table and check at construction that their modules register exactly these parameters;
``model_shapes`` counts parameters and bytes from it. Each parameter's offset in a block's flat
buffer is aligned to ``ALIGN_ELEMENTS`` elements.

Pure stdlib.
"""
from __future__ import annotations

import math

from dataclasses import dataclass

# Every parameter's offset inside a block's flat buffer is a multiple of this many elements
# (256 B in fp32, 128 B in bf16).
ALIGN_ELEMENTS = 64


@dataclass(frozen=True)
class Param:
    name: str  # inside the block, e.g. "self_attn.q_proj.weight"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def aligned(numel: int) -> int:
    """Elements a parameter of ``numel`` elements occupies in a block's flat buffer."""
    return -(-numel // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


def embedding_parameters(*, vocab_size: int, hidden_size: int) -> tuple[Param, ...]:
    return (Param("embed_tokens.weight", (vocab_size, hidden_size)),)


def layer_parameters(*, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int,
                     head_dim: int, attention_bias: bool, o_proj_bias: bool, mlp_bias: bool,
                     qk_norm: bool) -> tuple[Param, ...]:
    """One decoder layer. q width = heads x head_dim, k/v width = kv heads x head_dim."""
    h, i = hidden_size, intermediate_size
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    p: list[Param] = []

    def linear(name: str, n_in: int, n_out: int, bias: bool) -> None:
        p.append(Param(f"{name}.weight", (n_out, n_in)))
        if bias:
            p.append(Param(f"{name}.bias", (n_out,)))

    linear("self_attn.q_proj", h, q, attention_bias)
    linear("self_attn.k_proj", h, kv, attention_bias)
    linear("self_attn.v_proj", h, kv, attention_bias)
    linear("self_attn.o_proj", q, h, o_proj_bias)
    if qk_norm:
        p += [Param("self_attn.q_norm.weight", (head_dim,)), Param("self_attn.k_norm.weight", (head_dim,))]
    linear("mlp.gate_proj", h, i, mlp_bias)
    linear("mlp.up_proj", h, i, mlp_bias)
    linear("mlp.down_proj", i, h, mlp_bias)
    p += [Param("input_layernorm.weight", (h,)), Param("post_attention_layernorm.weight", (h,))]
    return tuple(p)


def head_parameters(*, hidden_size: int, vocab_size: int, tie_word_embeddings: bool) -> tuple[Param, ...]:
    """Final norm, and lm_head unless it is the embedding's weight."""
    norm = Param("norm.weight", (hidden_size,))
    return (norm,) if tie_word_embeddings else (norm, Param("lm_head.weight", (vocab_size, hidden_size)))
