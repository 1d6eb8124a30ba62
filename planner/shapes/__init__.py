"""What is trained, in numbers: a model's parameters, bytes and FLOPs per block, and what one step is asked to do.

Modules: ``model_shapes.py`` (``ModelShape``: parameters, bytes and FLOPs per block from the family's table; the
presets), ``model_flops.py`` (FLOPs per token: the model convention that model TFLOP/s counts, 6 x N_matmul, and
the hardware's apart), ``expert_shapes.py`` (a sparse MLP in numbers: experts, active parameters, a group of
experts as laid out in a slot, the group sizes the search tries), ``workload.py`` (``Workload``: the sequence
length, batch, dtype and clipping of a step; the fingerprint a plan records of it).

May import: the standard library, ``megatrain.errors``, the plan contract (``megatrain.plan``) and the stdlib
halves of ``megatrain.models``; nothing else of the planner.
"""
