"""The training step: device weight slots and their loader (``weight_slots``; a spilled fp32 master read off the
compute thread, ``spilled_loads``), the load sequences of a step and of evaluation (``step_schedule``), the
executor that runs one block-major step (``executor``), activation checkpoints (``activation_checkpoints``), kept
layers' forward graphs (``kept_layers``), fp32 gradient accumulators and their drain (``grad_buffers``), a block's
gradient once computed: norms, drain, the hand-off to the optimizer (``block_updates``), and the step timer
(``step_timer``). The step's mixture-of-experts work, layers streamed in parts and the routers' statistics, is
the ``experts`` sub-package's.

May import: every lower floor (base modules, ``device``, ``model``, ``spill``, ``state``, ``distributed``,
``optim``); never ``io`` or the Engine. Of ``experts``, the modules here other than the executor import
``expert_parts`` alone."""
