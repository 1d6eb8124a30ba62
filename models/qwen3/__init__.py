"""Qwen3 (transformers' ``Qwen3ForCausalLM``): Llama with RMSNorm on queries and keys, and Qwen2's window."""
