"""The training state in host memory: the RAM arenas per buffer kind (``host_store``), the model's state over
them (``model_state``: block table, AdamW step counts, state dicts), and each rank's shard of every block
(``shards``).

May import: ``megatrain.runtime``'s base modules, ``device``, ``model``, ``spill``, the planner's data modules."""
