"""Qwen2 / Qwen2.5 (transformers' ``Qwen2ForCausalLM``): Llama with a bias on q, k and v, and a layered window."""
