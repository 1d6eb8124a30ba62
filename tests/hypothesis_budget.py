"""How many examples the slowest property tests run under the hypothesis profile ``HYPOTHESIS_PROFILE`` names
(registered in conftest.py): ``fast`` (the default) a fifth of their count, ``thorough`` and ``slow`` all of it."""
from __future__ import annotations

import os

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "fast")
FAST_SHARE = 5


def examples(thorough: int) -> int:
    """``thorough`` examples under the thorough profile, a fifth of them (at least 5) under fast."""
    return thorough if PROFILE != "fast" else max(5, thorough // FAST_SHARE)
