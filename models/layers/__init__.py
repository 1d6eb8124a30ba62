"""The shared torch layers of the Llama-style decoder: causal attention, RoPE, RMSNorm, the gated MLP, the decoder
layer skeleton and the embedding and head blocks (``decoder``). A family whose blocks differ builds its own from
these. Torch; imports nothing of megatrain but ``megatrain.models``' stdlib half."""
