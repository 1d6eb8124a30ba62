"""The optimizer: the CPU AdamW worker and its bf16 state's stochastic rounding, its spilled state's read-ahead use,
the resident blocks' AdamW on the device, and the face the training step hands its (gradient, event) pairs to and
asks when a block is updated.

Modules: ``block_optimizer.py`` (the optimizer's face to the step), ``cpu_adamw.py`` (the AdamW worker thread),
``device_adamw.py`` (the resident blocks' AdamW on the device), ``adamw_kernel.py`` (torch's fused AdamW on a
block's flat buffers), ``stochastic_rounding.py`` (bf16 m and v, widened for the kernel and rounded back at
random).

May import: every lower floor (base modules, ``device``, ``model``, ``spill``, ``state``, ``distributed``) and the
plan contract; never ``pipeline``, ``io`` or the Engine.
"""
