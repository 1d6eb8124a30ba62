"""A sparse layer computed in parts whose weights stream apart (architecture only): its dense part (attention,
the norms, the router, Qwen2-MoE's shared expert) and groups of its experts. The runtime's
[Note: expert groups] (``runtime/pipeline/experts/expert_parts.py``) says when each part's weights are resident.

``dense`` runs the attention half and routes: the tokens the experts read (the post-attention norm of h), the
routing, and the shared expert's term. ``route`` sorts a micro-batch's (token, choice) pairs by expert once
(``sorted_experts.sort_pairs``) and reads the per-expert starts to the host once: one host sync per layer pass
and micro-batch, which slices each group's rows (grouped path) or each expert's (loop). ``add_group`` runs
experts [first, first + g) through ``sorted_experts.add_experts`` as ``Experts.forward`` runs all of them, on the
path the same rule picks ([Note: grouped experts]), their weighted outputs added into ``out`` with
``index_add_`` in ascending expert order; over every group in turn that is the whole layer's computation in its
order (on the CPU bitwise; on CUDA's grouped path the kernel's tiles may differ with the group's shape).
``finish`` adds the shared term and the residual as ``SparseMLP`` and ``DecoderLayer`` do.

The pre-norm decoder layer whose sparse MLP names its router (``ROUTER``: Qwen-MoE and Mixtral's ``gate``,
gpt-oss's ``router``) and whose experts are ``FusedExperts`` splits so (``splits``); a group's parameters are its
rows of every fused expert tensor (``expert_names``: gpt-oss's biases with their experts). Another layer streams
whole.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.func import functional_call

from megatrain.models.layers.attention import Documents
from megatrain.models.layers.decoder import DecoderLayer
from megatrain.models.layers.sorted_experts import FusedExperts, SortedPairs, add_experts, sort_pairs

EXPERTS = "mlp.experts."  # the prefix of a layer's fused expert tensors


class Routing(NamedTuple):
    weights: torch.Tensor  # [T, k]: each token's expert weights (in the compute dtype where the family casts them)
    pairs: SortedPairs  # the (token, choice) pairs sorted by expert, their starts read to the host


class Routed(NamedTuple):
    """A micro-batch after the dense part: what the expert groups and ``finish`` read."""
    h: torch.Tensor  # [b, S, hidden]: the residual after attention
    tokens: torch.Tensor  # [b x S, hidden]: the experts' input, the post-attention norm of h
    routing: Routing
    shared: torch.Tensor | None  # [b x S, hidden]: sigmoid(shared_expert_gate) x shared_expert; None without one


def splits(layer: nn.Module) -> bool:
    """Whether ``layer`` (a decoder-layer template) computes in a dense part and expert groups as this module does."""
    mlp = getattr(layer, "mlp", None)
    return (isinstance(layer, DecoderLayer) and type(layer).mlp_branch is DecoderLayer.mlp_branch
            and isinstance(getattr(mlp, "experts", None), FusedExperts) and hasattr(mlp, "ROUTER"))


def expert_names(layer: nn.Module) -> tuple[str, ...]:
    """The local names of a splitting layer's fused expert tensors (one row per expert each), in layout order."""
    return tuple(EXPERTS + name for name in layer.mlp.experts.FUSED)


def _sub(params: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}


def dense(layer: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          documents: Documents | None, attention_tile_tokens: int) -> Routed:
    """The dense part of ``layer`` over x [b, S, hidden], its parameters ``params`` (no expert tensor) bound."""
    h = functional_call(layer, params, (x, cos, sin, documents, 0, "attention", attention_tile_tokens))
    t = functional_call(layer.post_attention_layernorm, _sub(params, "post_attention_layernorm."), (h,))
    tokens = t.reshape(-1, t.shape[-1])
    mlp = layer.mlp
    weights, experts = functional_call(getattr(mlp, mlp.ROUTER), _sub(params, f"mlp.{mlp.ROUTER}."), (tokens,))
    if getattr(mlp, "weights_in_compute_dtype", False):
        weights = weights.to(x.dtype)
    shared = None
    if hasattr(mlp, "shared_expert"):
        gate = functional_call(mlp.shared_expert_gate, _sub(params, "mlp.shared_expert_gate."), (tokens,))
        shared = torch.sigmoid(gate) * functional_call(mlp.shared_expert, _sub(params, "mlp.shared_expert."),
                                                       (tokens,))
    return Routed(h, tokens, route(weights, experts, getattr(mlp, mlp.ROUTER).weight.shape[0]), shared)


def route(weights: torch.Tensor, experts: torch.Tensor, num_experts: int) -> Routing:
    """The (token, choice) pairs of experts [T, k] sorted by expert, and each expert's range (one host read)."""
    return Routing(weights, sort_pairs(experts, num_experts, read_starts=True))


def add_group(layer: nn.Module, out: torch.Tensor, tokens: torch.Tensor, routing: Routing,
              params: dict[str, torch.Tensor], first: int) -> bool:
    """Experts [first, first + g) (``params``: their rows [g, ...] of each fused tensor, by local name) over their
    tokens (tokens [T, hidden]), their weighted outputs added into out [T, hidden], as the experts' forward adds
    them. Returns whether any of them had a token."""
    tensors = layer.mlp.experts.tensors(_sub(params, EXPERTS))
    return add_experts(out, tokens, routing.weights, routing.pairs, tensors, first)


def finish(routed: Routed, experts_out: torch.Tensor) -> torch.Tensor:
    """The layer's output [b, S, hidden]: h + (experts' outputs + the shared term), as the whole layer adds them."""
    out = experts_out if routed.shared is None else experts_out + routed.shared
    return routed.h + out.reshape(routed.h.shape)
