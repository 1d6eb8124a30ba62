"""The training step: device weight slots and their loader, the step schedule, the executor that runs one
block-major step, rotary positions, activation checkpoints, sequence tiles, the head's chunked loss, gradient
accumulators, block updates (norms, drains, the hand-off to the optimizer) and the step timer.

May import: every lower floor (base modules, ``device``, ``model``, ``spill``, ``state``, ``distributed``, ``optim``); never
``io`` or the Engine."""
