"""Model and optimizer configuration: frozen, validated, Hugging Face field names.

``ModelConfig`` is ``megatrain.models.model_config``'s, the one description of a model the planner takes too,
re-exported here for the engine's users; a ``config.json`` is read by ``megatrain.models.hf_config`` (its module
docstring holds the audit of every field: each is honoured as transformers honours it or refused with one line).
``OptimizerConfig`` is AdamW's, checked by ``config_ranges``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatrain.models.hf_config import (SUPPORTED_ACTIVATIONS, SUPPORTED_MODEL_TYPES, SUPPORTED_ROPE_TYPES,
                                        read_config_json)
from megatrain.models.model_config import ModelConfig

from megatrain.runtime.config_ranges import check_optimizer_ranges

__all__ = ["ModelConfig", "OptimizerConfig", "read_config_json", "SUPPORTED_ACTIVATIONS", "SUPPORTED_MODEL_TYPES",
           "SUPPORTED_ROPE_TYPES"]


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW hyper-parameters, as ``torch.optim.AdamW`` takes them.

    ``max_grad_norm=None`` means no clipping (and allows the eager optimizer).
    Weight decay applies to every parameter except those whose Hugging Face name
    contains one of the ``no_decay`` patterns (e.g. ``("norm", "bias")``).
    """

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    no_decay: tuple[str, ...] = field(default_factory=tuple)
    skip_nonfinite: bool = False  # a non-finite gradient skips the update (runtime/optim/cpu_adamw.py)
    # AdamW m and v kept as "fp32", or "bf16" with stochastic rounding (runtime/optim/stochastic_rounding.py)
    state_dtype: str = "fp32"

    def __post_init__(self) -> None:
        check_optimizer_ranges(self)  # every check; what follows only normalises
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        if isinstance(self.no_decay, str):
            object.__setattr__(self, "no_decay", (self.no_decay,))
        object.__setattr__(self, "no_decay", tuple(self.no_decay))

    @property
    def clipping(self) -> bool:
        return self.max_grad_norm is not None

    def decays(self, hf_name: str) -> bool:
        return self.weight_decay > 0 and not any(p in hf_name for p in self.no_decay)
