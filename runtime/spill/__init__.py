"""The NVMe tier: asynchronous file I/O backends (``spill_io``), spill files with their staging sets
(``spill_files``), and spill directories named after their owner (``spill_dirs``).

May import: ``megatrain.runtime``'s base modules, ``device``, the planner's pure-stdlib data modules."""
