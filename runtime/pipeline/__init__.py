"""The training step: device weight slots and their loader, the step schedule, the executor that runs one
block-major step, rotary positions, activation checkpoints, sequence tiles, the head's chunked loss, gradient
accumulators, block updates (norms, drains, the hand-off to the optimizer), layers streamed in parts, and the step
timer.

Modules: ``executor.py`` (one block-major step, evaluation, logits), ``step_schedule.py`` (the load sequences and
the update order), ``weight_slots.py`` (device weight slots and their loader), ``spilled_loads.py`` (the loader
thread for spilled masters), ``block_updates.py`` (a block's gradient: norms, drain, AdamW update),
``grad_buffers.py`` (fp32 device gradient accumulators and their drain), ``activation_checkpoints.py`` (checkpoints
at block boundaries), ``kept_layers.py`` (a layer's forward graph kept for its backward), ``layer_backward.py`` (a
recomputed layer's backward), ``sequence_tiles.py`` (a layer's token-local work in sequence tiles),
``rotary_positions.py`` (RoPE tables and documents per layer type), ``head_loss.py`` (the head's chunked loss),
``router_balance.py`` (a step's routing and the load-balancing loss), ``expert_parts.py`` (a sparse layer's parts
as ranges of its block), ``expert_layers.py`` (the executor's work on a layer streamed in parts),
``step_timer.py`` (where a step's time goes).

May import: every lower floor (base modules, ``device``, ``model``, ``spill``, ``state``, ``distributed``, ``optim``)
and the plan contract; never ``io`` or the Engine.
"""
