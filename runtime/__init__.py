"""megatrain.runtime: stream a model's blocks through a few device slots; weights and AdamW state in host memory.

The public API is re-exported here. The runtime is layered in floors, one sub-folder each, the base modules at the
bottom and the Engine's facade at the top (DESIGN.md section 1); a floor imports its own and those below it.

Modules: the base: ``errors.py`` (the runtime's error types), ``paths.py`` (user paths checked where they enter),
``config.py`` (``ModelConfig``, ``OptimizerConfig``), ``config_ranges.py`` (the range of every number and flag);
the floors: ``device/``, ``model/``, ``spill/``, ``state/``, ``distributed/``, ``optim/``, ``pipeline/``, ``io/``;
the facade: ``engine.py`` (the public ``Engine``), ``engine_arguments.py`` (its arguments checked, the device
picked), ``step_inputs.py`` (what a step is given, checked and made the executor's batch), ``batch_limits.py`` (a
batch refused before it is allocated when its activations cannot fit), ``state_io.py`` (the state in and out of
files).

May import: torch, numpy, psutil, tensorstore, safetensors (kvikio only in its I/O backend), ``megatrain.errors``,
``megatrain.models``, the plan contract (``megatrain.plan``) and, of the planner, only its entry point
``megatrain.planner.first_batch``; never the tools.
"""
from megatrain.plan.plan import Plan, PlanError, SpillBlocks

from megatrain.runtime.config import ModelConfig, OptimizerConfig
from megatrain.runtime.device.host_heap import keep_freed_heap
from megatrain.runtime.engine import Engine
from megatrain.runtime.errors import CheckpointError, ClosedError, ConfigError, InputError, MegatrainError

__all__ = ["Engine", "ModelConfig", "OptimizerConfig", "Plan", "PlanError", "SpillBlocks", "MegatrainError",
           "ConfigError", "InputError", "CheckpointError", "ClosedError", "keep_freed_heap"]
