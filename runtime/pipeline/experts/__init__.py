"""The step's mixture-of-experts work: a sparse layer streamed in parts, its dense part and its expert groups
([Note: expert groups]): the parts as ranges of the block laid out in a slot, the slot size and what streaming in
parts refuses (``expert_parts``), and the executor's work on each load of a layer in parts (``expert_layers``);
and the routers of a step: per-expert token counts and the load-balancing loss built block by block
([Note: router balance], ``router_balance``).

May import: every lower floor (base modules, ``device``, ``model``, ``spill``, ``state``, ``distributed``,
``optim``) and of the pipeline the step's pieces these modules work with (``step_schedule``, ``grad_buffers``,
``block_updates``, ``activation_checkpoints``); never the executor, ``io`` or the Engine. ``expert_parts`` imports
nothing of the pipeline: the step's schedule and gradient buffers read its ``Part``."""
