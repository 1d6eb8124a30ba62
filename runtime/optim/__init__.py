"""The optimizer: the CPU AdamW worker (``cpu_adamw``) and its bf16 state's one-pass update (``bf16_adamw``, compiled
by ``native_adamw``, with ``stochastic_rounding``'s noise), its spilled state's read-ahead use, and the face the
training step hands its (gradient, event) pairs to and asks when a block is updated.

May import: every lower floor (base modules, ``device``, ``model``, ``spill``, ``state``, ``distributed``); never
``pipeline``, ``io`` or the Engine."""
