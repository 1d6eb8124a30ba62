"""The block table: one stateless meta-device template per block structure, built from the model family's blocks
(``megatrain.models``), and each block's flat layout (``templates``).

May import: ``megatrain.runtime``'s base modules (errors, config), ``megatrain.models``, the planner's pure-stdlib
data modules."""
