"""The NVMe tier: the one face of the state a plan spills, through which the host store, the optimizer and the loads
reach the disk; asynchronous file I/O backends, spill files with their staging sets, the AdamW worker's read-ahead
through them in the step's update order, and spill directories named after their owner.

Modules: ``spilled_state.py`` (the one face of the spilled state), ``spill_io.py`` (asynchronous file I/O: POSIX
and kvikio backends), ``spill_files.py`` (the kinds a plan keeps on disk, the order of their writes),
``staging_pool.py`` (the staging sets and a chunk staged in one), ``read_ahead.py`` (the AdamW worker's spill I/O,
read ahead in the update order), ``lent_masters.py`` (staged masters lent to the loads), ``busy_clock.py`` (the
disk's busy time), ``spill_dirs.py`` (spill directories and their reclaiming).

May import: ``megatrain.runtime``'s base modules, ``device``, the plan contract.
"""
