"""``--model``: the built-in demo, a planner preset, a Hugging Face directory or Hub name, or a config.json.

Returns the ModelConfig to train and, for a directory with safetensors weights, the path to load
them from (``Engine.from_pretrained``). Random weights only when asked for: the demo, a preset, a
bare config.json, or ``--init random``; a directory whose weights megatrain cannot read is refused.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass

from megatrain.planner.shapes import model_shapes
from megatrain.runtime import ModelConfig
from megatrain.runtime.io import hf_io

from . import hub_models
from .train_config import DEMO_MODEL, TrainConfigError

# Weight files megatrain never reads (pickles, TensorFlow, Flax, GGUF): named in the refusal.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".h5", ".msgpack", ".gguf")


@dataclass(frozen=True)
class ModelSource:
    config: ModelConfig
    # A Hugging Face directory whose weights to load; None: random init.
    pretrained: str | None
    description: str


def demo_config(vocab_size: int, seq_len: int) -> ModelConfig:
    """The demo model: the default family's decoder, 4 layers of width 256, ~3.3M parameters with a 257-id byte vocabulary."""
    return ModelConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(seq_len, 256))


def resolve(model: str, vocab_size: int, seq_len: int, init: str = "auto", revision: str = "") -> ModelSource:
    """``vocab_size``: the tokenizer's (the demo model is sized to it; other models must cover it).

    A model directory's weights are loaded (``init="auto"``) or ignored (``"random"``); a directory with no
    weights megatrain reads is refused unless ``init="random"``: random init only when asked for. A Hub name
    (``org/name``, no local path of that name) is its snapshot at ``revision`` (tools/hub_models.py).
    """
    if model == DEMO_MODEL:
        return ModelSource(demo_config(vocab_size, seq_len), None, "demo model (random init)")
    if hub_models.is_hub_name(model):
        at = f"@{revision}" if revision else ""
        return _covers(_directory(hub_models.snapshot(model, revision), init, f"{model}{at}, Hugging Face cache"),
                       vocab_size)
    if os.path.isdir(model):
        source = _directory(model, init, model)
    elif os.path.isfile(model):
        source = ModelSource(ModelConfig.from_hf(model), None, f"{model} (random init)")
    else:
        try:
            shape = model_shapes.resolve(model)
        except model_shapes.BarePresetName as e:
            raise TrainConfigError(f"model: {e} for its shape with random weights, or its Hugging Face Hub name "
                                   f"(org/name) for the published weights") from None
        except model_shapes.ModelShapeError as e:
            raise TrainConfigError(f"model: {e}; or 'demo', a Hugging Face directory or a config.json") from None
        source = ModelSource(_from_shape(shape), None, f"preset {shape.name} (random init)")
    return _covers(source, vocab_size)


def _directory(model: str, init: str, label: str) -> ModelSource:
    """A Hugging Face model directory: its weights (``init="auto"``, refused when absent) or its config alone."""
    if not os.path.exists(os.path.join(model, "config.json")):
        raise TrainConfigError(f"model: {model} has no config.json; pass a Hugging Face model directory")
    config = ModelConfig.from_hf(model)
    if init == "random":
        return ModelSource(config, None, f"{label} (random init: --init random)")
    _require_weights(model)
    return ModelSource(config, model, f"{label} (pretrained weights)")


def _covers(source: ModelSource, vocab_size: int) -> ModelSource:
    """The model's vocabulary holds the tokenizer's ids."""
    if vocab_size > source.config.vocab_size:
        raise TrainConfigError(f"tokenizer has {vocab_size} ids but the model's vocab_size is "
                               f"{source.config.vocab_size}; pass the model's own tokenizer.json with --tokenizer")
    return source


def position_warning(config: ModelConfig, seq_len: int) -> str | None:
    """A sequence longer than the model's positions trains (RoPE extrapolates), but not as the model was trained."""
    limit = config.max_position_embeddings
    if limit and seq_len > limit:
        return (f"seq_len {seq_len} exceeds the model's max_position_embeddings {limit}: positions beyond it were "
                f"never trained (RoPE extrapolates); lower --seq-len, or raise max_position_embeddings with a "
                f"rope_scaling that covers it in config.json")
    return None


def _require_weights(model: str) -> None:
    """The directory's safetensors (index checked); else one line: what is there and how to convert it."""
    if glob.glob(os.path.join(model, "*.safetensors")) or os.path.exists(os.path.join(model, hf_io.INDEX_FILE)):
        hf_io.find_shards(model)  # the index names files that exist
        return
    others = sorted(os.path.basename(p) for ext in PICKLE_SUFFIXES for p in glob.glob(os.path.join(model, "*" + ext)))
    if others:
        raise TrainConfigError(
            f"model: {model} holds {others[0]} but no *.safetensors: megatrain reads only safetensors (it never "
            f"unpickles .bin/.pt files); "
            f"convert it to safetensors, e.g. python -c \"from transformers import AutoModelForCausalLM; "
            f"AutoModelForCausalLM.from_pretrained('{model}').save_pretrained('{model}', safe_serialization=True)\", "
            f"or pass --init random to train its config from random weights")
    raise TrainConfigError(f"model: {model} has config.json but no *.safetensors weights; add them, or pass "
                           f"--init random to train its config from random weights")


def _from_shape(shape: model_shapes.ModelShape) -> ModelConfig:
    """A preset's ModelConfig: its config.json fields as read into its shape (the family's rules)."""
    assert shape.model is not None, shape.name  # every preset is read from its family's config fields
    return shape.model
