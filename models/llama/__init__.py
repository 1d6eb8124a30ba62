"""Llama (transformers' ``LlamaForCausalLM``): the decoder the shared blocks of ``models/layers`` implement.

Modules: ``family.py`` (its config rules, parameter table and presets; it uses the shared blocks of ``layers``).

May import: the standard library, ``megatrain.errors`` and the stdlib half of ``megatrain.models``.
"""
