"""What a model's step costs in FLOPs per token: the model convention that model TFLOP/s counts, and the hardware
FLOPs the device really runs. Pure stdlib.

[Note: model FLOPs] Model TFLOP/s = 6 x N_matmul x (non-padded tokens) / step time. N_matmul
(``matmul_params_active``) is the parameters of the matrix multiplies one token runs through: every layer's 2-D
weights (q, k, v, o, the MLP's or the router's and the experts the token is routed to) and lm_head (vocab x hidden,
counted even when it is the tied embedding's weight: the multiply runs). The input embedding is a lookup, norms and
biases are not matmuls: neither counts. 6 = 2 (forward) + 4 (backward: dX and dW). Recompute is not counted. Beside
it, the every-parameter figure ``all_params_flops_per_token`` = 6 x ``params_active`` (every parameter a token
uses, the embedding included) is reported, as earlier figures counted.

Attention by the model convention (``attention_model_flops_per_token``): causal, QK^T and PV cost half of
4 x S x (heads x head_dim) per layer per token in forward, and backward counts 2x forward
(``ATTENTION_MODEL_BWD_FACTOR``). Hardware FLOPs are apart (``hardware_flops_per_token``): they count every layer's
recompute and flash attention's real backward, 2.5x its forward (``ATTENTION_BWD_FACTOR``: QK^T again, dV, dP, dQ,
dK); the cost model times the device with them.
"""
from __future__ import annotations

import functools

from megatrain.plan.block_parameters import LAYER

# Causal attention backward over its forward as the device runs it (flash backward: QK^T again, dV, dP, dQ, dK):
# the hardware term, what the cost model and the profiler's attention rate count.
ATTENTION_BWD_FACTOR = 2.5
# Causal attention backward over its forward by the model-FLOP convention (dX and dW-like: two of forward's cost).
ATTENTION_MODEL_BWD_FACTOR = 2.0


def attention_flops_per_token(heads: int, head_dim: int, seq: int) -> float:
    """Causal attention FLOPs per token in forward, averaged over a sequence of ``seq`` tokens.

    QK^T and PV each cost 2 x heads x head_dim x (keys seen); a causal token sees (seq + 1) / 2 keys
    on average, so 2 x 2 x heads x head_dim x (seq + 1) / 2 = 2 x heads x head_dim x (seq + 1).
    """
    return 2.0 * heads * head_dim * (seq + 1)


class ModelFlops:
    """FLOPs per token of a ``ModelShape`` (mixed into it; reads its dimensions, parameter table and experts)."""

    @functools.cached_property
    def params_active(self) -> int:
        """The parameters one token runs through: ``params`` less the experts it is not routed to (dense: all).
        The embedding is included: the every-parameter count."""
        return self.params - self.num_layers * self.experts.inactive_params_layer(self.hidden_size)

    @functools.cached_property
    def matmul_weights_layer(self) -> int:
        """Elements of one layer's matmul weights a token runs through: its 2-D parameters (norms and biases are
        not matmuls) and the experts it is routed to (num_experts_per_tok of them)."""
        dense = sum(p.numel for p in self.table(LAYER) if len(p.shape) == 2)
        return dense + self.experts.num_experts_per_tok * self.experts.expert_params(self.hidden_size)

    @functools.cached_property
    def matmul_params_active(self) -> int:
        """N_matmul ([Note: model FLOPs]): L x ``matmul_weights_layer`` + lm_head's vocab x hidden (its multiply
        runs whether or not its weight is the embedding's); the input embedding (a lookup) is not counted."""
        return self.num_layers * self.matmul_weights_layer + self.vocab_size * self.hidden_size

    def attention_flops_fwd(self, seq: int) -> float:
        """Causal attention FLOPs per token in forward (``attention_flops_per_token``)."""
        return attention_flops_per_token(self.num_heads, self.head_dim, seq)

    def attention_flops_bwd(self, seq: int) -> float:
        """Causal attention backward per token as the device runs it: ATTENTION_BWD_FACTOR x forward (hardware)."""
        return ATTENTION_BWD_FACTOR * self.attention_flops_fwd(seq)

    def attention_model_flops_per_token(self, seq: int) -> float:
        """Causal attention FLOPs per token of the whole model in one step by the model convention, forward and
        backward at ``seq`` tokens per sequence: L x (1 + ATTENTION_MODEL_BWD_FACTOR) x attention_flops_fwd
        = L x 3 x 2 x heads x head_dim x (seq + 1). Recompute not counted; what "TFLOP/s with attention" adds."""
        return self.num_layers * (1.0 + ATTENTION_MODEL_BWD_FACTOR) * self.attention_flops_fwd(seq)

    def attention_hardware_flops_per_token(self, seq: int) -> float:
        """Causal attention FLOPs per token of one step as flash runs it, without recompute:
        L x (attention_flops_fwd + attention_flops_bwd) = L x 3.5 x attention_flops_fwd."""
        return self.num_layers * (self.attention_flops_fwd(seq) + self.attention_flops_bwd(seq))

    def layer_flops_fwd(self, seq: int) -> float:
        """One decoder layer, forward, per token: 2 x matmul weights + causal attention."""
        return 2.0 * self.matmul_weights_layer + self.attention_flops_fwd(seq)

    def expert_flops_fwd(self) -> float:
        """The routed experts' matmul FLOPs per token in one layer's forward, inside ``layer_flops_fwd``:
        2 x num_experts_per_tok x expert_params (the shared expert and the router are not in it: they run as a
        dense MLP does); 0 when dense. Backward is twice this, recompute once more (as for the layer's)."""
        return 2.0 * self.experts.num_experts_per_tok * self.experts.expert_params(self.hidden_size)

    def layer_flops_bwd(self, seq: int) -> float:
        """One decoder layer, backward (without recompute), per token: 4 x matmul weights (dX, dW) + attention's
        (hardware: flash's real backward)."""
        return 4.0 * self.matmul_weights_layer + self.attention_flops_bwd(seq)

    def layer_flops_recompute(self, seq: int) -> float:
        """Recompute before backward is one more forward of the layer: same as ``layer_flops_fwd``."""
        return self.layer_flops_fwd(seq)

    def head_flops_fwd(self) -> float:
        """lm_head forward per token: 2 x vocab x hidden (the embedding is a gather: no FLOPs)."""
        return 2.0 * self.vocab_size * self.hidden_size

    def head_flops_bwd(self) -> float:
        """lm_head backward per token (dX and dW): 4 x vocab x hidden. The runtime runs it in forward."""
        return 4.0 * self.vocab_size * self.hidden_size

    def model_flops_per_token(self) -> float:
        """FLOPs per token that model TFLOP/s counts ([Note: model FLOPs]): 6 x N_matmul (a mixture of experts
        counts the experts a token is routed to), no recompute, no attention."""
        return 6.0 * self.matmul_params_active

    def all_params_flops_per_token(self) -> float:
        """The every-parameter figure reported beside it: 6 x ``params_active`` (the input embedding included)."""
        return 6.0 * self.params_active

    def hardware_flops_per_token(self, seq: int) -> float:
        """FLOPs per token the GPU really runs in one step: every layer's forward, recompute and
        backward (flash attention's real backward), plus the head's forward and backward."""
        per_layer = self.layer_flops_fwd(seq) + self.layer_flops_recompute(seq) + self.layer_flops_bwd(seq)
        return self.num_layers * per_layer + self.head_flops_fwd() + self.head_flops_bwd()
