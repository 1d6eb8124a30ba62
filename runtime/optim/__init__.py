"""The optimizer: the CPU AdamW worker and its bf16 state's one-pass update, its spilled state's read-ahead use,
the resident blocks' AdamW on the device, and the face the training step hands its (gradient, event) pairs to and
asks when a block is updated.

Modules: ``block_optimizer.py`` (the optimizer's face to the step), ``cpu_adamw.py`` (the AdamW worker thread),
``job_queue.py`` (the worker's jobs and its one wait), ``device_adamw.py`` (the resident blocks' AdamW on the
device), ``adamw_kernel.py`` (torch's fused AdamW on a block's flat buffers), ``bf16_adamw.py`` (AdamW with bf16 m
and v in one pass per element: the compiled loop or its torch twin, the same bits), ``native_adamw.py`` (that loop
as C++, built with g++ at first use), ``stochastic_rounding.py`` (the counter-based noise and the rounding in torch
ops).

May import: every lower floor (base modules, ``device``, ``model``, ``spill``, ``state``, ``distributed``) and the
plan contract; never ``pipeline``, ``io`` or the Engine.
"""
