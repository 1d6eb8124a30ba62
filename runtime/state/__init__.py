"""The training state in host memory: the RAM arenas per buffer kind, the model's state over them, the resident
blocks' state on the device, and each rank's shard of every block.

Modules: ``host_store.py`` (the RAM arenas, one per buffer kind), ``model_state.py`` (block table, host store, AdamW
step counts, state dicts), ``resident_state.py`` (the resident blocks' master, m, v and gradient in device memory),
``shards.py`` (each rank's shard of every block).

May import: ``megatrain.runtime``'s base modules, ``device``, ``model``, ``spill``, the plan contract.
"""
