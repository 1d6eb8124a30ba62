"""Data parallelism: the process group and topology, the collectives of a step on their own stream, and a rank's
sharded model state.

Modules: ``process_group.py`` (this process's rank, the topology, the process group's initialisation, a rank's
exit), ``collectives.py`` (slot all-gather, gradient reduce-scatter, the norm and token-count all-reduces),
``sharded_state.py`` (a rank's model state: whole blocks gathered from and kept as shards).

May import: ``megatrain.runtime``'s base modules, ``device``, ``model``, ``state``, the plan contract.
"""
