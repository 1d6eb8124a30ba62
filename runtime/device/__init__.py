"""What the device offers the step: CUDA streams and events with their no-op CPU stand-ins, the log of issued
operations the schedule tests read, the busy time of a timed step's work on a side stream, and the host threads and
heap the step runs on.

Modules: ``streams.py`` (streams and events, the same interface on CUDA and on CPU), ``event_log.py`` (the step's
operations in the order the host issued them), ``busy_events.py`` (a side stream's busy time in a timed step: the
device AdamW's), ``host_threads.py`` (a helper thread's intra-op threads), ``host_heap.py`` (``keep_freed_heap``:
the memory a step frees kept for the next one).

May import: the standard library and torch; nothing else of megatrain.
"""
