"""The block table: one stateless meta-device template per block structure, built from the model family's blocks
(``megatrain.models``), and each block's flat layout.

Modules: ``templates.py`` (the block table, each block's flat layout and Hugging Face names), ``layer_types.py``
(the configuration a decoder layer of each type is built from).

May import: ``megatrain.runtime``'s base modules (errors, config), ``megatrain.models``, the plan contract.
"""
