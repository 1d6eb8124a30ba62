"""Choosing the plan: the fastest plan that fits every budget (or the budget no plan fits), the one request
``megatrain-plan plan`` and ``megatrain-train`` both choose through, and what a machine can train or what to buy.

Modules: ``search.py`` (the plan search), ``candidate_fit.py`` (one candidate fitted to the budgets: expert groups,
RAM filled first and the rest spilled, the most kept layers, the largest loss chunk), ``plan_variants.py`` (the variants of a fitted candidate timed beside it:
every layer recomputed, optimizer state on the device), ``spill_choices.py`` (the spill settings the search tries:
the chunk, the staging depths, O_DIRECT or not), ``sequence_pieces.py`` (how the search cuts a micro-batch's
tokens: sequence tiles, the pieces of a host checkpoint copy), ``plan_request.py`` (``choose_plan``: the one way a
plan is chosen), ``sizing.py`` (what a machine can train, and what RAM and NVMe to buy), ``ram_answers.py`` (``megatrain-plan
ram``'s independent searches run side by side), ``side_by_side.py`` (independent work in forked processes, one a
core: the search's candidates, ``ram``'s rows).

May import: the standard library, ``megatrain.errors``, the plan contract, the stdlib halves of
``megatrain.models``, ``shapes/``, ``profiling/`` and ``costs/``.
"""
