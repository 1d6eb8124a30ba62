"""Qwen2-MoE (transformers' ``Qwen2MoeForCausalLM``): Qwen2's attention, and a sparse MLP on every layer with a
shared expert.

Modules: ``family.py`` (its config rules, parameter table and presets; stdlib), ``blocks.py`` (its torch blocks).

May import: ``family``: the standard library, ``megatrain.errors`` and the stdlib half of ``megatrain.models``;
``blocks``: torch and ``megatrain.models`` (its ``layers``).
"""
