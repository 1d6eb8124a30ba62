"""State in and out of files: training checkpoints, their directory, their on-disk format and the sharded variant,
and Hugging Face directories (streamed safetensors, config.json).

Modules: ``training_checkpoint.py`` (a model state's checkpoint written and committed atomically, in the background,
and read back), ``checkpoint_directory.py`` (a checkpoint directory's ``step-<N>`` folders and ``latest`` pointer),
``checkpoint_format.py`` (the on-disk format: zarr v3 arrays, the manifest, CRC32s), ``crc32s.py`` (CRC32s of a
byte stream cut at fixed boundaries), ``sharded_checkpoint.py`` (a data-parallel run's checkpoints),
``hf_io.py`` (Hugging Face directories in and out), ``mxfp4.py`` (MXFP4 expert tensors dequantized on load),
``finite_weights.py`` (weights holding NaN or infinity refused where a model is read or written).

May import: the base modules, ``device``, ``model``, ``spill``, ``state``, ``distributed``, the plan contract; never
``pipeline`` or the Engine.
"""
