"""The NVMe tier: the one face of the state a plan spills, through which the host store, the optimizer and the
loads reach the disk (``spilled_state``); asynchronous file I/O backends (``spill_io``), spill files with their
staging sets (``spill_files``), the AdamW worker's read-ahead through them in the step's update order
(``read_ahead``), and spill directories named after their owner (``spill_dirs``).

May import: ``megatrain.runtime``'s base modules, ``device``, the planner's pure-stdlib data modules."""
