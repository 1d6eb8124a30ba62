"""The model as the runtime computes it, stateless (no stream, slot or host state): the block table, one meta-device
template per block structure built from the model family's blocks (``megatrain.models``) with each block's flat
layout; what a layer takes besides its input; a layer's forward eager or compiled; a recomputed layer's backward;
the head's chunked loss.

Modules: ``templates.py`` (the block table, each block's flat layout and Hugging Face names), ``layer_types.py``
(the configuration a decoder layer of each type is built from), ``rotary_positions.py`` (RoPE tables and documents
per layer type), ``compiled_layers.py`` (a decoder layer's forward eager or through ``torch.compile``,
``Plan.compiled_layers``), ``layer_backward.py`` (a recomputed layer's backward for one micro-batch, whole or in
tiles), ``sequence_tiles.py`` (a layer's token-local work, norm and MLP, in sequence tiles), ``head_loss.py``
(final norm, lm_head and cross-entropy forward and backward at once, in chunks).

May import: ``megatrain.runtime``'s base modules (errors, config), ``megatrain.models``, the plan contract.
"""
