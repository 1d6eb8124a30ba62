"""Hypothesis profiles, chosen by the environment variable HYPOTHESIS_PROFILE:

- ``fast`` (the default, what CI runs): 100 examples a property test; the slowest ones
  (``hypothesis_budget.examples``) a fifth of their count, so that the default run stays quick; derandomized, so
  every run of the same code draws the same examples and a red run can be run again to the same result (random
  draws found rare float-noise cases beyond the numerics bounds, which made CI pass or fail by luck). Hypothesis
  also mixes in literals it reads from the project's loaded modules, so a change anywhere in the code may change
  the examples a property test draws: a property must hold for every example, not for today's;
- ``thorough``: every property test at its full count (100, or its own), random draws;
- ``slow``: 1000 examples a test, random draws, exploring much more (``HYPOTHESIS_PROFILE=slow pytest -m "slow or not slow"``).
"""
from __future__ import annotations

from hypothesis import settings

from hypothesis_budget import PROFILE

settings.register_profile("fast", max_examples=100, deadline=None, derandomize=True)
settings.register_profile("thorough", max_examples=100, deadline=None)
settings.register_profile("slow", max_examples=1000, deadline=None)
settings.load_profile(PROFILE)

# tqdm's monitor thread outlives the bars of the in-process megatrain-train runs. The planner forks its search only
# from a process with no other thread (planner/choice/side_by_side.py), as megatrain-plan runs: without the monitor,
# the planner tests after those runs plan side by side as the command does.
try:
    import tqdm
    tqdm.tqdm.monitor_interval = 0
except ImportError:
    pass
