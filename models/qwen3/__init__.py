"""Qwen3 (transformers' ``Qwen3ForCausalLM``): Llama with RMSNorm on queries and keys, and Qwen2's window.

Modules: ``family.py`` (its config rules, parameter table and presets; it uses the shared blocks of ``layers``).

May import: the standard library, ``megatrain.errors`` and the stdlib half of ``megatrain.models``.
"""
