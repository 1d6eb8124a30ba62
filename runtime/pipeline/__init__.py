"""The training step: device weight slots and their loader, the step schedule, the executor that runs one
block-major step, rotary positions, activation checkpoints, sequence tiles, the head's chunked loss, gradient
accumulators, block updates (norms, drains, AdamW hand-off), the CPU AdamW worker (and its bf16 state's stochastic
rounding) and the step timer.

May import: every lower floor (base modules, ``device``, ``model``, ``spill``, ``state``, ``distributed``); never
``io`` or the Engine."""
