"""The optimizer: the CPU AdamW worker (``cpu_adamw``) and its bf16 state's stochastic rounding
(``stochastic_rounding``), its spilled state's read-ahead use, and the face the training step hands its
(gradient, event) pairs to and asks when a block is updated.

May import: every lower floor (base modules, ``device``, ``model``, ``spill``, ``state``, ``distributed``); never
``pipeline``, ``io`` or the Engine."""
