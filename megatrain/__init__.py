"""megatrain: full-precision training of models far larger than GPU memory, on one GPU.

The import name ``megatrain`` is made of the repository's folders (pyproject.toml's package-dir), in floors, lowest
first; each imports its own floor and those below (DESIGN.md section 1).

Modules: ``errors.py`` (``MegatrainError``, the base of every user-facing error), ``models/`` (the model families),
``plan/`` (the plan contract the planner writes and the runtime reads), ``planner/`` (measuring the machine,
pricing and choosing the plan, ``megatrain-plan``), ``runtime/`` (the ``Engine`` that executes a plan), ``tools/``
(``megatrain-train``, ``megatrain-export``, ``megatrain-plan calibrate``).

May import: the standard library (``errors``); the packages, as their own docstrings say.
"""
__version__ = "0.1.0"
