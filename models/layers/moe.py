"""The sparse MLP of a mixture-of-experts layer, computed as transformers 5 computes it (architecture only).

Router: logits = x @ gate.weight^T [T, E]; probabilities = softmax in float32; the top-k experts of each token
and their probabilities, renormalised to sum to 1 when ``norm_topk_prob`` (Mixtral always); the runtime's
observer (``routing_observer``), when one is installed, sees the logits and the chosen experts. Experts: each a
gated MLP down(act(gate(x)) * up(x)) over the tokens routed to it, its output scaled by the token's weight and
added into the token's row (``index_add_``), run over the routing sorted by expert as grouped matrix multiplies or
expert by expert ([Note: grouped experts] in ``sorted_experts.py``: which path runs where). Qwen2-MoE adds a
shared expert every token runs through, scaled by sigmoid(shared_expert_gate(x)).

An expert no token is routed to gets no row: its gradient is zero, and AdamW (megatrain's, as
``torch.optim.AdamW`` on transformers' fused expert tensors) still moves its moments and decays it. The grouped
path reads nothing to the host; the loop reads the per-expert counts once per layer pass (transformers' loop once
per expert); the output does not depend on the order of the tokens or on sequence tiles.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from megatrain.models.model_config import ModelConfig
from megatrain.models.layers import routing_observer
from megatrain.models.layers.decoder import ACTIVATIONS, MLP
from megatrain.models.layers.sorted_experts import ExpertTensors, FusedExperts


class Router(nn.Module):
    """``mlp.gate``: [E, hidden]; returns the top-k weights [T, k] and expert indices [T, k] of tokens [T, hidden]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.top_k: int = config.num_experts_per_tok
        self.norm_topk_prob: bool = config.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        observer = routing_observer.current()  # the runtime's statistics and load-balancing loss, if any
        if observer is not None:
            logits = observer.logits(logits)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if observer is not None:
            observer.routed(experts)
        return weights, experts


class Experts(FusedExperts):
    """``mlp.experts``: gate_up_proj [E, 2I, hidden] (gate rows, then up rows), down_proj [E, hidden, I]."""

    FUSED = ("gate_up_proj", "down_proj")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.act_fn = ACTIVATIONS[config.hidden_act]

    def tensors(self, fused: Mapping[str, torch.Tensor]) -> ExpertTensors:
        """Input-major views of the output-major fused tensors, the chunked GLU."""
        return ExpertTensors(fused["gate_up_proj"].transpose(1, 2), fused["down_proj"].transpose(1, 2), self.glu)

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2I] (gate, then up) -> act(gate) x up [n, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up


class SparseMLP(nn.Module):
    """Router and experts (registered in the family's order: ``router_first``), and the shared expert with its
    gate when ``shared_expert_intermediate_size`` > 0. x [B, S, hidden] -> [B, S, hidden]."""

    ROUTER = "gate"  # the router's attribute (expert_group.dense routes with it)

    def __init__(self, config: ModelConfig, router_first: bool = True, weights_in_compute_dtype: bool = True) -> None:
        super().__init__()
        if router_first:
            self.gate = Router(config)
            self.experts = Experts(config)
        else:
            self.experts = Experts(config)
            self.gate = Router(config)
        # Mixtral scales each expert's output by the float32 weight; the Qwen families cast the weights first.
        self.weights_in_compute_dtype = weights_in_compute_dtype
        shared = config.shared_expert_intermediate_size
        if shared:
            self.shared_expert = MLP(_Width(config, shared))
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
        weights, experts = self.gate(tokens)
        if self.weights_in_compute_dtype:
            weights = weights.to(x.dtype)
        out = self.experts(tokens, weights, experts)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        return out.reshape(b, s, h)


class _Width:
    """A config whose MLP width is another: the shared expert's (no bias, the model's activation)."""

    def __init__(self, config: ModelConfig, width: int) -> None:
        self.hidden_size = config.hidden_size
        self.intermediate_size = width
        self.mlp_bias = False
        self.hidden_act = config.hidden_act
