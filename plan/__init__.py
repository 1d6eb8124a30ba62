"""The plan contract: what the planner writes and the runtime reads, as data, below both of them.

The planner chooses a ``Plan``; the runtime executes it and makes no policy decisions of its own. What both sides
must agree on to the byte lives here, once: the plan itself, the checks its fields share, the workload a plan was
chosen for, the host buffer kinds with the blocks a plan spills, and each block's parameter layout.

Modules: ``plan.py`` (the ``Plan``, ``SpillBlocks``, the default plan), ``plan_checks.py`` (``PlanError`` and the
checks the plan's fields share), ``workload_fingerprint.py`` (the model digest, dtype and batch a plan was chosen
for), ``buffer_kinds.py`` (``BufferKind``, which blocks of which kinds a plan spills, the spill files' alignment),
``block_parameters.py`` (each block's parameters in order, asked of the family, and their alignment in a flat
buffer).

May import: the standard library, ``megatrain.errors`` and the stdlib halves of ``megatrain.models``; never the
planner, the runtime or the tools.
"""
