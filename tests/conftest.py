import os

from hypothesis import settings

# CI runs the default profile; `HYPOTHESIS_PROFILE=slow pytest -m "slow or not slow"` explores much more.
settings.register_profile("default", max_examples=100, deadline=None)
settings.register_profile("slow", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
