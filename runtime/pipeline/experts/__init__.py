"""The step's mixture-of-experts work: a sparse layer streamed in parts, its dense part and its expert groups
([Note: expert groups]), and the routers of a step ([Note: router balance]).

Modules: ``expert_parts.py`` (the parts as ranges of the block laid out in a slot, the slot size and what streaming
in parts refuses), ``expert_layers.py`` (the executor's work on each load of a layer in parts),
``router_balance.py`` (per-expert token counts and the load-balancing loss built block by block).

May import: every lower floor (base modules, ``device``, ``model``, ``spill``, ``state``, ``distributed``,
``optim``), the plan contract, and of the pipeline the step's pieces these modules work with (``step_schedule``,
``grad_buffers``, ``block_updates``, ``activation_checkpoints``); never the executor, ``io`` or the Engine.
``expert_parts`` imports nothing of the pipeline: the step's schedule and gradient buffers read its ``Part``.
"""
