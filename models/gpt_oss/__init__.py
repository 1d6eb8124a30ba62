"""gpt-oss (transformers' ``GptOssForCausalLM``): biased attention with a learned sink per head, and a sparse MLP
on every layer with a biased router and the clamped SwiGLU.

Modules: ``family.py`` (its config rules, parameter table and presets; stdlib), ``blocks.py`` (its torch blocks).

May import: ``family``: the standard library, ``megatrain.errors`` and the stdlib half of ``megatrain.models``;
``blocks``: torch and ``megatrain.models`` (its ``layers``).
"""
