"""What a plan costs: every buffer it allocates (the memory model, term by term) and the time of its step (the cost
model, phase by phase), on one GPU or per rank of several.

Modules: ``memory_model.py`` (every buffer of a plan with its formula, summed), ``plan_memory.py`` (a plan's memory
priced once, cached, and the budgets it overruns), ``budget_boundary.py`` (the last of a row of settings that fits
its budgets: the most kept layers, the least fill level, the largest loss chunk), ``allocator_retention.py`` (what
glibc's heap keeps of a CPU step's freed temporaries), ``attention_memory.py`` (the attention call's memory: the
runtime's head groups and what one call's backward adds), ``moe_memory.py`` (a mixture-of-experts layer's memory,
term by term), ``sparse_working_set.py`` (a sparse layer's working set, and the state a layer in expert groups
holds between its loads), ``kept_layers.py`` (selective recompute: which layers keep their activations, and what
that costs), ``resident_blocks.py`` (optimizer state on the device: which blocks, what it costs and saves),
``stream_units.py`` (what one weight slot and one device gradient accumulator hold), ``spill_placement.py`` (which
blocks of which kinds a plan keeps on disk: their sizes, the order the search fills the disk in),
``cost_model.py`` (the step's time, phase by phase, and the resource that bounds each), ``adam_time.py`` (the
CPU AdamW's seconds per block), ``step_replay.py`` (a
step's block visits replayed on the three streams and the AdamW workers), ``step_traffic.py`` (the bytes a step
copies and moves on disk, and the attention FLOPs the device runs), ``spill_timing.py`` (a spilled step without a
GPU: the disk beside the CPU in each half of the step), ``data_parallel.py`` (one rank's memory, the collectives'
time, the scaling efficiency against one GPU).

May import: the standard library, ``megatrain.errors``, the plan contract, the stdlib halves of
``megatrain.models``, ``shapes/`` and ``profiling/``.
"""
