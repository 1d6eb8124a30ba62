"""Qwen2 / Qwen2.5 (transformers' ``Qwen2ForCausalLM``): Llama with a bias on q, k and v, and a layered window.

Modules: ``family.py`` (its config rules, parameter table and presets; it uses the shared blocks of ``layers``).

May import: the standard library, ``megatrain.errors`` and the stdlib half of ``megatrain.models``.
"""
