"""The model as the runtime computes it, stateless (no stream, slot or host state): the block table, one
meta-device template per block structure built from the model family's blocks (``megatrain.models``) with each
block's flat layout (``templates``), and the configuration of each layer type (``layer_types``); what a layer takes
besides its input, its RoPE tables and documents (``rotary_positions``); a recomputed layer's backward
(``layer_backward``), whole or with its token-local work in sequence tiles (``sequence_tiles``); and the head's
loss, final norm, lm_head and cross-entropy forward and backward at once in chunks (``head_loss``).

May import: ``megatrain.runtime``'s base modules (errors, config), ``megatrain.models``, the planner's
pure-stdlib data modules."""
