"""OLMo 2: post-norms and q/k norms over the whole projection (``family.py``, ``blocks.py``)."""
