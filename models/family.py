"""``Family``: what one ``model_type`` is, as data the planner, the runtime and the HF I/O ask. Pure stdlib.

A family says how transformers reads its config.json (``read``: the fields that differ between families, and the
defaults that do), which configuration fields are its own (``fields``: ``ModelConfig`` holds them, the blocks and
the parameter table read them), what its config.json holds when megatrain writes one (``write``), its parameter table and
Hugging Face names (``embedding``, ``layer``, ``head``, ``hf_name``; by default the Llama-style tables of
``parameters.py``), its presets, and where its torch blocks are (``blocks``: a module path the runtime imports,
never the planner). ``registry`` holds one per ``model_type``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .parameters import EMBED, HEAD, LAYER, DiskTensor, Param, llama_embedding, llama_head, llama_hf_name, llama_layer

Dims = Mapping[str, Any]  # a model's dimensions by their config.json names (ModelConfig.to_dict())
# The shared Llama-style blocks (torch): a family whose blocks are those names this module.
LLAMA_BLOCKS = "megatrain.models.layers.decoder"


@dataclass(frozen=True)
class FamilyField:
    """A configuration field one family reads and the others do not (Gemma 3's ``query_pre_attn_scalar``).

    ``ModelConfig`` holds it among its ``family_fields`` (read as ``config.<name>``), the parameter table sees it in
    its ``dims`` and the family's blocks in their config. ``default``: its value in a ``ModelConfig`` built without
    it; ``check(name, value)``: the value as kept, or ``ConfigError`` in one line naming ``name``. The family's
    ``read`` returns it from a config.json (with transformers' default there) and its ``write`` writes it back.
    """

    name: str
    default: Any
    check: Callable[[str, Any], Any]


@dataclass(frozen=True)
class Preset:
    """A published model by name, as the fields of its config.json (read like any other config)."""

    name: str
    config: Mapping[str, Any]


@dataclass(frozen=True)
class Family:
    """One ``model_type``. ``read(data, num_hidden_layers)`` returns the family's fields of ``ModelConfig``
    (``attention_bias``, ``o_proj_bias``, ``mlp_bias``, ``qk_norm``, ``sliding_window``, ``layer_types``, and its own
    ``fields``) from a config dict, refusing what transformers' class for it would not build; ``write(config)`` the family's own
    config.json fields for a ``ModelConfig``. ``defaults``: transformers' config defaults for fields a config may
    leave out (``max_position_embeddings``, ``head_dim``, ``rms_norm_eps``, ...; ``rope``: the RoPE fields of a
    config that states none)."""

    model_type: str
    architecture: str  # the transformers class, e.g. "LlamaForCausalLM"
    read: Callable[[Mapping[str, Any], int], dict[str, Any]]
    write: Callable[[Any], dict[str, Any]]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    fields: tuple[FamilyField, ...] = ()
    presets: tuple[Preset, ...] = ()
    embedding: Callable[[Dims], tuple[Param, ...]] = llama_embedding
    layer: Callable[[Dims], tuple[Param, ...]] = llama_layer
    head: Callable[[Dims], tuple[Param, ...]] = llama_head
    hf_name: Callable[[str, "int | None", str], str] = llama_hf_name
    blocks: str = LLAMA_BLOCKS
    # The weight with which a norm scales by one, what a new model's norms start at (Gemma's (1 + w) norms: 0).
    unit_norm_weight: float = 1.0
    # A layer parameter's tensors in Hugging Face files when they are not the one tensor ``hf_name`` names
    # (``moe.per_expert_names``); None, or returning None: that one tensor.
    layer_disk_tensors: Callable[[int, Param], "tuple[DiskTensor, ...] | None"] | None = None

    # Whether a sparse layer of this family streams in a dense part and expert groups ([Note: expert groups]); the
    # planner chooses groups only for a family whose blocks compute that way.
    expert_groups: bool = True

    def parameters(self, dims: Dims, kind: str) -> tuple[Param, ...]:
        """The parameter table of a block of ``kind`` (``EMBED``, ``LAYER``, ``HEAD``), in layout order."""
        table = {EMBED: self.embedding, LAYER: self.layer, HEAD: self.head}[kind]
        return table(dims)

    def disk_tensors(self, kind: str, layer: int | None, param: Param) -> tuple[DiskTensor, ...]:
        """The tensors a Hugging Face checkpoint holds ``param`` of a block of ``kind`` in, as transformers'
        ``save_pretrained`` writes them."""
        split = self.layer_disk_tensors(layer, param) if kind == LAYER and self.layer_disk_tensors else None
        return split or (DiskTensor(self.hf_name(kind, layer, param.name), param.shape, 0),)
