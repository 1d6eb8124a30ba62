"""The planner: measures the machine, prices a plan in memory and time, and chooses the fastest plan that fits.

What the planner writes, the runtime reads: the plan contract below both (``megatrain.plan``). The planner never
imports the runtime or the tools; the runtime asks its policy through one module, ``first_batch``.

Modules: ``shapes/`` (a model and a step's workload in numbers: parameters, bytes, FLOPs), ``profiling/`` (the
machine in numbers: the hardware profile, its presets, measuring it, the constants fitted from real steps),
``costs/`` (what a plan costs: the memory model, the step's time, spill placement, data parallelism), ``choice/``
(choosing the plan: the search, its variants, the one plan request, sizing), ``commands/`` (``megatrain-plan``: its
parser, one module per command, what each prints), ``first_batch.py`` (the runtime's one entry point: the layers
the default plan keeps for its first batch, a micro-batch's activation bytes), ``plan.py`` (the ``Plan``'s former
import path: the contract's classes re-exported).

May import: the standard library, psutil, ``megatrain.errors``, the plan contract ``megatrain.plan`` and the stdlib
halves of ``megatrain.models``; torch only inside ``profiling/profiler.py`` and ``host_rates.py``, in the functions
that measure a device; never the runtime or the tools. Each sub-folder imports only those before it in the list
above (``shapes/`` the lowest, ``commands/`` any of them); no sub-folder imports ``first_batch`` or ``plan``.
"""
