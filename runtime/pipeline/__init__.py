"""The training step: device weight slots and their loader, the step schedule, the executor that runs one
block-major step, activation checkpoints, kept layers, gradient accumulators, block updates (norms, drains, the
hand-off to the optimizer), and the step timer. The step's mixture-of-experts work, layers streamed in parts and the
routers' statistics, is the ``experts`` sub-package's.

Modules: ``executor.py`` (one block-major step, evaluation, logits), ``step_schedule.py`` (the load sequences and
the update order), ``weight_slots.py`` (device weight slots and their loader), ``spilled_loads.py`` (the loader
thread for spilled masters), ``block_updates.py`` (a block's gradient: norms, drain, AdamW update),
``grad_buffers.py`` (fp32 device gradient accumulators and their drain), ``activation_checkpoints.py`` (checkpoints
at block boundaries), ``kept_layers.py`` (a layer's forward graph kept for its backward), ``step_timer.py`` (where a
step's time goes), ``experts/`` (layers streamed in expert groups, the routers' statistics).

May import: every lower floor (base modules, ``device``, ``model``, ``spill``, ``state``, ``distributed``,
``optim``) and the plan contract; never ``io`` or the Engine. Of ``experts``, the modules here other than the
executor import ``expert_parts`` alone.
"""
