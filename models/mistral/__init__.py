"""Mistral (transformers' ``MistralForCausalLM``): Llama without biases, with a window on every layer."""
