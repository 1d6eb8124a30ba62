"""A model's sparse MLP in numbers: its experts, how many a token runs through, their widths. Pure stdlib.

``ModelShape.experts`` holds one; a dense model's is all zeros. Active parameters (what model TFLOP/s counts,
6 x active N per token) leave out, in each layer, the experts a token is not routed to. Expert groups (the
runtime's [Note: expert groups]): a layer's fused expert tensors and one group of them as the runtime lays them
out in a slot (``experts_numel``, ``group_numel``), what the memory model sizes slots by, and the group sizes
the search tries (``group_sizes``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from megatrain.plan.block_parameters import aligned


@dataclass(frozen=True)
class ExpertShape:
    """``ModelConfig``'s expert fields (``megatrain.models.moe``), for the planner's counts."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # The top-k weights renormalised to sum to 1 (Mixtral always); the load-balancing loss's weight (None: off).
    # What the routers save for backward depends on both (``moe_memory``); neither changes a parameter.
    norm_topk_prob: bool = False
    router_aux_loss_coef: float | None = None

    @classmethod
    def of(cls, fields: Any) -> "ExpertShape":
        """The expert fields of a ``ModelConfig``."""
        return cls(**{k: getattr(fields, k) for k in asdict(cls())})

    def dims(self) -> Mapping[str, int]:
        """The counts by their config names, for the family's parameter table and the plan's shape digest."""
        return {k: v for k, v in asdict(self).items() if k not in ("norm_topk_prob", "router_aux_loss_coef")}

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

    def experts_numel(self, hidden_size: int, rows: tuple[int, ...] | None = None) -> int:
        """Elements of a layer's fused expert tensors in its flat buffer: X = a(E x 2I x h) + a(E x h x I), a(n) n
        rounded up to the layout's 64 elements (gate_up_proj [E, 2I, h], then down_proj [E, h, I]); ``rows``:
        each fused tensor's elements per expert, in layout order, where the family has others (gpt-oss's
        biases: 2I and h)."""
        return sum(aligned(self.num_experts * r) for r in rows or self._rows(hidden_size))

    def group_numel(self, hidden_size: int, group: int, rows: tuple[int, ...] | None = None) -> int:
        """Elements of the largest group of ``group`` experts in a slot: Xg = a(g x 2I x h) + a(g x h x I) for a
        whole group (a sum over ``rows``, as ``experts_numel``), and for the last one (E - lo experts from lo,
        reaching to the end of each fused tensor's padding) a(a(E x 2I x h) - lo x 2I x h) + a(a(E x h x I) -
        lo x h x I); the larger."""
        e, rows = self.num_experts, rows or self._rows(hidden_size)
        g = min(group, e)
        lo = (e - 1) // g * g  # the last group's first expert
        last = sum(aligned(aligned(e * r) - lo * r) for r in rows)
        return max(sum(aligned(g * r) for r in rows), last) if lo else last

    def _rows(self, hidden_size: int) -> tuple[int, int]:
        return 2 * self.moe_intermediate_size * hidden_size, hidden_size * self.moe_intermediate_size

    def group_sizes(self) -> tuple[int | None, ...]:
        """The expert-group sizes the search tries, fewest groups first: whole layers (None), then every divisor
        g of E from E down to 1 (E: the dense part and all the experts apart). A dense model: whole layers."""
        e = self.num_experts
        return (None, *(g for g in range(e, 0, -1) if e % g == 0)) if e else (None,)
