"""Mistral (transformers' ``MistralForCausalLM``): Llama without biases, with a window on every layer.

Modules: ``family.py`` (its config rules, parameter table and presets; it uses the shared blocks of ``layers``).

May import: the standard library, ``megatrain.errors`` and the stdlib half of ``megatrain.models``.
"""
