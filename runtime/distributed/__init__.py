"""Data parallelism: the process group and topology (``process_group``), the collectives of a step on their own
stream (``collectives``), and a rank's sharded model state (``sharded_state``).

May import: ``megatrain.runtime``'s base modules, ``device``, ``model``, ``state``, the planner's data modules."""
