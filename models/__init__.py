"""The model: ``ModelConfig`` (``model_config``: the one description the planner and the runtime take, read from a
config.json by ``hf_config``), and the families: each supported ``model_type`` in one folder, and the registry.

A family owns its config.json rules, its parameter table (names, shapes, order, Hugging Face names), its
presets (stdlib: ``family.py`` of its folder) and its torch blocks (``blocks.py``, or the shared Llama blocks of
``layers/``). ``registry`` finds a family by ``model_type``. The stdlib halves import no torch (the planner
reads them); nothing here imports the runtime, the planner or the tools.

Modules: ``model_config.py`` (``ModelConfig``, the one description of a model the planner and the runtime take),
``model_config_checks.py`` (its checks, in one place), ``registry.py`` (the families by ``model_type``),
``family.py`` (``Family``: what one ``model_type`` is, as data), ``hf_config.py`` (the one reader of a Hugging Face
config.json), ``config_fields.py`` (typed config.json fields and the rules families share), ``parameters.py`` (the
Llama-style parameter tables and Hugging Face names), ``moe.py`` (mixture-of-experts layers as data), ``errors.py``
(the families' errors), ``block_classes.py`` (the torch half of the registry: a family's block classes), ``layers/``
(the shared torch layers); one folder per family: ``llama/``, ``qwen2/``, ``qwen3/``, ``mistral/``, ``phi3/``,
``olmo2/``, ``gemma3_text/``, ``mixtral/``, ``qwen3_moe/``, ``qwen2_moe/``, ``gpt_oss/``.

May import: the standard library and ``megatrain.errors``; torch only in ``layers/``, ``block_classes`` and
the families' ``blocks`` modules.
"""
