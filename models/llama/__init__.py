"""Llama (transformers' ``LlamaForCausalLM``): the decoder the shared blocks of ``models/layers`` implement."""
