"""The shared torch layers of the Llama-style decoder: causal attention, RoPE, RMSNorm, the gated MLP, the decoder
layer skeleton and the embedding and head blocks, the sparse MLP of mixture-of-experts layers. A family whose blocks
differ builds its own from these.

Modules: ``decoder.py`` (the Llama-style blocks: embedding, decoder layer, head; RMSNorm and the gated MLP),
``attention.py`` (causal attention at any length, over whole rows or packed documents), ``rope.py`` (rotary
position embeddings), ``moe.py`` (the sparse MLP: router, fused experts, a shared expert), ``sorted_experts.py``
(experts run over routed pairs sorted by expert), ``expert_group.py`` (a sparse layer computed in parts whose
weights stream apart), ``routing_observer.py`` (where the runtime watches the routers).

May import: torch, and of megatrain only ``megatrain.models``' stdlib half.
"""
