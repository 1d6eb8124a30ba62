"""Phi-3: fused qkv and gate/up projections (``family.py``, ``blocks.py``)."""
