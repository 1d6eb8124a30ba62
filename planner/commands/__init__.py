"""``megatrain-plan``, the command line: its parser and dispatch, its value types and shared options, one module
per command (its options, ``add_parser``, and what it computes, ``run``), and what each command prints.

Modules: ``cli.py`` (the parser and dispatch; ``main``, the ``megatrain-plan`` program), ``cli_args.py`` (the value
types, a bad value refused in one line, and the option groups commands share), ``overview.py``, ``profile.py``,
``plan.py``, ``size.py``, ``ram.py`` (one command each; ``overview``: no command), ``report.py`` (what every command
prints: units, tables, a plan's figures), ``report_overview.py``, ``report_plan.py``, ``report_size.py``,
``report_ram.py`` (each command's text and JSON), ``data_parallel_report.py`` (``--gpus-per-node`` and ``--nodes``:
the options and the figures of a data-parallel plan).

May import: the standard library, ``megatrain.errors``, the plan contract, the stdlib halves of
``megatrain.models`` and the rest of the planner (``shapes/``, ``profiling/``, ``costs/``, ``choice/``).
"""
