"""The model's computation, stateless: decoder blocks, RoPE and attention as transformers computes them, and the
block table of meta-device templates with each block's flat layout (``templates``).

May import: ``megatrain.runtime``'s base modules (errors, config), the planner's pure-stdlib data modules."""
