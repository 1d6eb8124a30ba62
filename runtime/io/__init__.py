"""State in and out of files: training checkpoints, their directory, their on-disk format and the sharded variant,
and Hugging Face directories (streamed safetensors, config.json).

May import: the base modules, ``device``, ``model``, ``spill``, ``state``, ``distributed``; never ``pipeline`` or the
Engine."""
