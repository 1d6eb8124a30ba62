"""Gemma 3's text model (transformers' ``Gemma3ForCausalLM``): scaled embeddings, (1 + w) norms around attention
and MLP, q/k norms, local (sliding) and global layers with their own RoPE, soft-capped logits."""
