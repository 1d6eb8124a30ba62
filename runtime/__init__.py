"""megatrain.runtime: stream a model's blocks through a few device slots; weights and AdamW state in host memory."""
from megatrain.plan.plan import Plan, PlanError, SpillBlocks

from megatrain.runtime.config import ModelConfig, OptimizerConfig
from megatrain.runtime.device.host_heap import keep_freed_heap
from megatrain.runtime.engine import Engine
from megatrain.runtime.errors import CheckpointError, ClosedError, ConfigError, InputError, MegatrainError

__all__ = ["Engine", "ModelConfig", "OptimizerConfig", "Plan", "PlanError", "SpillBlocks", "MegatrainError",
           "ConfigError", "InputError", "CheckpointError", "ClosedError", "keep_freed_heap"]
