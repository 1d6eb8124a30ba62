"""The runtime's one way into the planner's policy: the default plan completed by its first batch.

``Engine(config)`` without a plan runs the contract's ``default_plan`` (``megatrain.plan.plan``), whose
micro-batch and kept layers its first training step's batch sets (runtime/step_inputs.py), and any engine refuses a
batch whose activations cannot fit the device before anything of it is allocated (runtime/batch_limits.py). Both
weigh a batch with the planner's memory model, and ask here for it, nowhere else in the planner
(tests/test_import_graph.py checks that the runtime imports no other planner module):

- ``kept_layers_for``: the layers the default plan keeps for its first batch, for the memory the device has free
  (``kept_layers.default_kept_layers``);
- ``activation_pricer``: what a micro-batch's activations take under a plan, by its rows and their length
  (``memory_model.activation_bytes``).

A model is given by its ``ModelConfig`` (``megatrain.models.model_config``), whose shape the planner derives in
one place (``model_shapes.of_model``).

Pure stdlib.
"""
from __future__ import annotations

import functools
from typing import Callable

from megatrain.models.model_config import ModelConfig

from megatrain.plan.plan import Plan

from .costs import memory_model
from .shapes import model_shapes
from .costs.kept_layers import default_kept_layers
from .shapes.workload import Workload

# The bytes a micro-batch of (rows, tokens per row) needs for its activations under a plan.
ActivationPricer = Callable[[int, int, Plan], int]


def activation_pricer(config: ModelConfig, dtype: str, clipping: bool) -> ActivationPricer:
    """The activation bytes of a micro-batch of the model ``config`` describes, in compute ``dtype`` ("bfloat16",
    "float32", ...), with or without gradient clipping."""
    shape = model_shapes.of_model(config)

    def needs(rows: int, seq: int, plan: Plan) -> int:
        return memory_model.activation_bytes(shape, Workload(seq, rows, dtype, clipping), plan)

    return needs


def kept_layers_for(config: ModelConfig, dtype: str, clipping: bool, plan: Plan, rows: int, seq: int,
                    free_bytes: int) -> tuple[int, ...]:
    """The layers the default ``plan`` keeps for batches of ``rows`` x ``seq`` tokens when the device has
    ``free_bytes`` free."""
    shape = model_shapes.of_model(config)
    work = Workload(seq, rows, dtype, clipping)
    needs = functools.partial(memory_model.activation_bytes, shape, work)
    return default_kept_layers(shape, work, plan, free_bytes, needs)
