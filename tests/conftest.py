"""Hypothesis profiles, chosen by the environment variable HYPOTHESIS_PROFILE:

- ``fast`` (the default): 100 examples a property test; the slowest ones (``hypothesis_budget.examples``) a fifth
  of their count, so that the default run stays quick;
- ``thorough``: every property test at its full count (100, or its own);
- ``slow``: 1000 examples a test, exploring much more (``HYPOTHESIS_PROFILE=slow pytest -m "slow or not slow"``).
"""
from __future__ import annotations

from hypothesis import settings

from hypothesis_budget import PROFILE

settings.register_profile("fast", max_examples=100, deadline=None)
settings.register_profile("thorough", max_examples=100, deadline=None)
settings.register_profile("slow", max_examples=1000, deadline=None)
settings.load_profile(PROFILE)
