"""Gemma 3's text model (transformers' ``Gemma3ForCausalLM``): scaled embeddings, (1 + w) norms around attention
and MLP, q/k norms, local (sliding) and global layers with their own RoPE, soft-capped logits.

Modules: ``family.py`` (its config rules, parameter table and presets; stdlib), ``blocks.py`` (its torch blocks).

May import: ``family``: the standard library, ``megatrain.errors`` and the stdlib half of ``megatrain.models``;
``blocks``: torch and ``megatrain.models`` (its ``layers``).
"""
