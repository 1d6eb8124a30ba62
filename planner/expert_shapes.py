"""A model's sparse MLP in numbers: its experts, how many a token runs through, their widths. Pure stdlib.

``ModelShape.experts`` holds one; a dense model's is all zeros. Active parameters (what model TFLOP/s counts,
6 x active N per token) leave out, in each layer, the experts a token is not routed to.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class ExpertShape:
    """``ModelConfig``'s expert fields (``megatrain.models.moe``), for the planner's counts."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    @classmethod
    def of(cls, fields: Any) -> "ExpertShape":
        """The expert fields of a config (``hf_config.DecoderConfig``, ``ModelConfig``)."""
        return cls(**{k: getattr(fields, k) for k in asdict(cls())})

    def dims(self) -> Mapping[str, int]:
        """The fields by their config names, for the family's parameter table."""
        return asdict(self)

    def inactive_params_layer(self, hidden_size: int) -> int:
        """One layer's parameters a token does not run through: the experts it is not routed to, 3 x hidden x
        moe_intermediate_size each (gate, up, down); 0 for a dense MLP."""
        return (self.num_experts - self.num_experts_per_tok) * self.expert_params(hidden_size)

    def expert_params(self, hidden_size: int) -> int:
        """One expert's parameters: 3 x hidden x moe_intermediate_size (0 when dense)."""
        return 3 * hidden_size * self.moe_intermediate_size

    def mlp_width(self, intermediate_size: int) -> int:
        """The MLP width one token runs through: ``intermediate_size`` when dense; else its experts' widths and
        the shared expert's."""
        if not self.num_experts:
            return intermediate_size
        return self.num_experts_per_tok * self.moe_intermediate_size + self.shared_expert_intermediate_size
