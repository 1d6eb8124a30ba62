"""The model: ``ModelConfig`` (``model_config``: the one description the planner and the runtime take, read from a
config.json by ``hf_config``), and the families: each supported ``model_type`` in one folder, and the registry.

A family owns its config.json rules, its parameter table (names, shapes, order, Hugging Face names), its
presets (stdlib: ``family.py`` of its folder) and its torch blocks (``blocks.py``, or the shared Llama blocks of
``layers/``). ``registry`` finds a family by ``model_type``. The stdlib halves import no torch (the planner
reads them); nothing here imports the runtime, the planner or the tools.

May import: the standard library and ``megatrain.errors``; torch only in ``layers/``, ``block_classes`` and
the families' ``blocks`` modules.
"""
