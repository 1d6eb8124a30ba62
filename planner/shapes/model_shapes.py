"""Model shapes: what a decoder-only transformer costs in parameters, bytes and FLOPs.

A ModelShape is the planner's arithmetic on a model: it is derived from the ``ModelConfig`` the runtime takes too
(``of_model``, the one place; a config.json or a preset is read into a ModelConfig first), and built directly only
where the planner sizes a model that has no config.json (``sizing``'s sweeps of layer counts, tests). Its fields
are the planner's names for the dimensions its formulas use (``num_layers``, ``num_heads``, ``num_kv_heads``);
``model`` keeps the ModelConfig it came from. Everything the memory and cost models need about a model is here,
per block, in the runtime's block order: embedding, each decoder layer, head (final norm + lm_head; when embeddings are tied the
head holds only the norm and borrows the embedding's weight, so the embedding block is loaded a second time).

The parameters of each block come from the model's family (``block_parameters`` asks ``megatrain.models``), the
table the runtime lays its blocks out from; the presets are the families' too. Each block is one flat buffer in the
runtime; each parameter's offset is aligned to ``ALIGN_ELEMENTS`` elements, so a block's buffer is slightly larger
than its parameter count. ``block_numel`` is the aligned size (what slots and arenas hold); ``params`` counts the
model's real parameters. FLOPs per token (the model convention model TFLOP/s counts, N_matmul, and the hardware
FLOPs apart) are ``ModelFlops``'s (``model_flops``), mixed in. Pure stdlib.
"""
from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from megatrain.errors import MegatrainError
from megatrain.models import hf_config
from megatrain.models.errors import ConfigError
from megatrain.models.model_config import ModelConfig

from megatrain.plan.buffer_kinds import spill_block_bytes
from megatrain.planner.shapes.expert_shapes import ExpertShape
from megatrain.planner.shapes.model_flops import (ATTENTION_BWD_FACTOR, ModelFlops,
                                                  attention_flops_per_token)  # noqa: F401 (their old home)
from megatrain.models import registry

from megatrain.plan.block_parameters import ALIGN_ELEMENTS, EMBED, HEAD, LAYER, aligned, block_table

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_ALIASES: dict[str, str] = {
    "fp32": "float32", "float": "float32", "float32": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "half": "float16", "float16": "float16",
}


class ModelShapeError(MegatrainError):
    """A model name, config file or config field cannot be used. One line: what, and the fix."""


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` ("bf16", "bfloat16", "fp32", ...)."""
    name = DTYPE_ALIASES.get(str(dtype).lower())
    if name is None:
        raise ModelShapeError(f"dtype={dtype!r} is unknown; use one of {', '.join(sorted(DTYPE_ALIASES))}")
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class ModelShape(ModelFlops):
    """The architecture numbers of a decoder of one of ``megatrain.models``' families (``model_type``)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    # Per-head width; a config may set it independently of hidden_size / num_heads.
    head_dim: int = 0
    tie_word_embeddings: bool = False
    # q, k and v projections carry a bias.
    attention_bias: bool = False
    # o_proj carries a bias; the MLP's projections do.
    o_proj_bias: bool = False
    mlp_bias: bool = False
    # RMSNorm of width head_dim on q and on k.
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = field(default=None, compare=False)
    max_position_embeddings: int = 4096
    model_type: str = registry.DEFAULT_MODEL_TYPE
    # A sparse MLP (megatrain.models.moe): its experts, how many each token runs, their width, a shared expert.
    experts: ExpertShape = ExpertShape()
    # The family's own fields (``Family.fields``), by name: its parameter table reads them, so they are part of the
    # shape (and of the cache key of ``table``).
    family_fields: tuple[tuple[str, Any], ...] = ()
    # The model this shape was derived from (``of_model``; a shape built directly: the ModelConfig of its fields,
    # which checks them): the runtime's configuration of a preset.
    model: ModelConfig | None = field(default=None, compare=False)
    # The config.json fields this shape was read from (``from_config``: a preset's, a file's).
    config: Mapping[str, Any] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.model is None:  # built directly: checked as the ModelConfig of these dimensions (its checks)
            object.__setattr__(self, "model", self._as_model())
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.model.head_dim)  # type: ignore[union-attr]

    def _as_model(self) -> ModelConfig:
        """The ModelConfig of a shape built directly, or ``ModelShapeError`` naming the shape and the field."""
        try:
            return ModelConfig(
                model_type=self.model_type, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
                num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim or None,
                tie_word_embeddings=self.tie_word_embeddings, attention_bias=self.attention_bias,
                o_proj_bias=self.o_proj_bias, mlp_bias=self.mlp_bias, qk_norm=self.qk_norm, rope_theta=self.rope_theta,
                rope_scaling=self.rope_scaling, max_position_embeddings=self.max_position_embeddings,
                family_fields=dict(self.family_fields), **asdict(self.experts))
        except ConfigError as e:
            raise ModelShapeError(f"{self.name}: {e}") from None

    # ---- parameters, per block ------------------------------------------------------------

    def config_dims(self) -> dict[str, Any]:
        """The dimensions by their config.json names: what the family's parameter table (with the family's own
        fields) and the plan's shape digest read."""
        return {**dict(self.family_fields),"model_type": self.model_type, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "vocab_size": self.vocab_size,
                "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
                "o_proj_bias": self.o_proj_bias, "mlp_bias": self.mlp_bias, "qk_norm": self.qk_norm,
                **self.experts.dims()}

    @functools.cache
    def table(self, kind: str) -> tuple[Any, ...]:
        """The family's parameter table of a block of ``kind`` (cached: the search asks for it thousands of times)."""
        return tuple(block_table(self.config_dims(), kind))

    def embedding_params(self) -> list[int]:
        """embed_tokens.weight: vocab x hidden."""
        return [p.numel for p in self.table(EMBED)]

    def layer_params(self) -> list[int]:
        """One decoder layer's parameters, in the order the runtime lays them out (the family's table)."""
        return [p.numel for p in self.table(LAYER)]

    def head_params(self) -> list[int]:
        """Final norm, plus lm_head (vocab x hidden) unless it is the embedding's weight."""
        return [p.numel for p in self.table(HEAD)]

    @functools.cached_property
    def params_embedding(self) -> int:
        return sum(self.embedding_params())

    @functools.cached_property
    def params_layer(self) -> int:
        return sum(self.layer_params())

    @functools.cached_property
    def params_head(self) -> int:
        return sum(self.head_params())

    @functools.cached_property
    def params(self) -> int:
        """Distinct parameters of the model (a tied weight counted once)."""
        return self.params_embedding + self.num_layers * self.params_layer + self.params_head

    @functools.cached_property
    def numel_embedding(self) -> int:
        return sum(aligned(n) for n in self.embedding_params())

    @functools.cached_property
    def numel_layer(self) -> int:
        return sum(aligned(n) for n in self.layer_params())

    @functools.cached_property
    def numel_head(self) -> int:
        return sum(aligned(n) for n in self.head_params())

    @functools.cached_property
    def numel_largest_block(self) -> int:
        """Elements of the largest flat block buffer: the size of one device slot."""
        return max(self.numel_embedding, self.numel_layer, self.numel_head)

    @functools.cached_property
    def numel_total(self) -> int:
        """Elements of every block's flat buffer, each distinct block once (host arena size)."""
        return self.numel_embedding + self.num_layers * self.numel_layer + self.numel_head

    @functools.cached_property
    def spill_file_bytes(self) -> int:
        """One fp32 kind of every distinct block in a spill file, each block rounded up to 4 KiB."""
        blocks = [self.numel_embedding] + [self.numel_layer] * self.num_layers + [self.numel_head]
        return sum(spill_block_bytes(n) for n in blocks)

    def block_bytes(self, dtype: str) -> dict[str, int]:
        """Bytes of each distinct block's flat buffer in ``dtype``."""
        b = dtype_bytes(dtype)
        return {"embedding": self.numel_embedding * b, "layer": self.numel_layer * b, "head": self.numel_head * b}

    # ---- FLOPs per token: ModelFlops (model_flops.py) --------------------------------------------

    # ---- activation bytes per token ----------------------------------------------------------

    def checkpoint_bytes_per_token(self, dtype: str) -> int:
        """One block-boundary activation: hidden x compute bytes."""
        return self.hidden_size * dtype_bytes(dtype)

    def layer_working_bytes_per_token(self, dtype: str) -> int:
        """Bytes per token one decoder layer holds at its peak (backward after recompute).

        An estimate from shapes, to be fitted from measurements. Autograd saves, in compute dtype
        (c bytes): the norm outputs and residual stream (5 x hidden: input, norm1 out, o_proj out,
        norm2 out, down out), q before and after RoPE plus the attention output (3 x q_width), k before
        and after RoPE plus v (3 x kv_width), the MLP's gate, up, act(gate) and their product
        (4 x intermediate); RMSNorm keeps fp32 copies of its input (2 x hidden x 4 bytes);
        SDPA (flash) keeps a logsumexp (heads x 4 bytes), O(seq) not O(seq^2). Backward adds
        transient gradients of the widest tensors (3 x intermediate + 2 x hidden, compute dtype).
        """
        c = dtype_bytes(dtype)
        h, i = self.hidden_size, self.experts.mlp_width(self.intermediate_size)
        qw, kvw = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        saved = c * (5 * h + 3 * qw + 3 * kvw + 4 * i) + 4 * 2 * h + 4 * self.num_heads
        transient = c * (3 * i + 2 * h)
        return saved + transient

    def mlp_working_bytes_per_token(self, dtype: str) -> int:
        """The MLP's share of ``layer_working_bytes_per_token``: gate, up, act(gate), their product saved and
        three transient gradients of that width, 7 x intermediate x c; what sequence tiles bound."""
        return 7 * self.experts.mlp_width(self.intermediate_size) * dtype_bytes(dtype)

    def attention_whole_bytes_per_token(self, dtype: str) -> int:
        """What a layer with its attention half in sequence tiles still holds for every token at its peak
        (attention's backward): q, k, v after RoPE, attention's output, its gradient, dq, dk, dv
        (4 x q_width + 4 x kv_width), h and dh (2 x hidden), in compute dtype, the logsumexp (heads x 4), and in
        bf16/fp16 flash backward's fp32 dq accumulator (q_width x 4)."""
        c = dtype_bytes(dtype)
        qw, kvw = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        accumulator = 4 * qw if c < 4 else 0
        return c * (4 * qw + 4 * kvw + 2 * self.hidden_size) + 4 * self.num_heads + accumulator

    def attention_tile_bytes_per_token(self, dtype: str) -> int:
        """The attention half's token-local work, held for one tile's tokens when tiled: the input norm's output
        and o_proj's output (2 x hidden), q and k before RoPE (q_width + kv_width), in compute dtype, and the
        norm's fp32 copy (hidden x 4)."""
        c = dtype_bytes(dtype)
        qw, kvw = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return c * (2 * self.hidden_size + qw + kvw) + 4 * self.hidden_size

    def logits_bytes_per_token(self, dtype: str) -> int:
        """Chunked cross-entropy's peak per token, V x (c + 12): the logits, their fp32 log-probabilities, and in
        backward the fp32 gradients of both (measured on a CPU: 14.0-14.4 bytes per logit in bf16, 16.1-16.5 fp32)."""
        return self.vocab_size * (dtype_bytes(dtype) + 12)

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name, "params": self.params, "params_active": self.params_active,
            "matmul_params_active": self.matmul_params_active,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_layers": self.num_layers,
            "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab_size, "tie_word_embeddings": self.tie_word_embeddings,
        }


# ---- a ModelConfig's shape; config.json read by ``hf_config``, the one reader -------------------------

def of_model(config: ModelConfig, name: str | None = None, source: Mapping[str, Any] | None = None) -> ModelShape:
    """The shape of ``config``'s model (``name``: the label reports use, absent: its model_type; ``source``: the
    config.json fields it was read from)."""
    return ModelShape(
        name=name or config.model_type,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,  # type: ignore[arg-type]  (resolved by ModelConfig)
        vocab_size=config.vocab_size,
        head_dim=config.head_dim or 0,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        o_proj_bias=bool(config.o_proj_bias),
        mlp_bias=config.mlp_bias,
        qk_norm=config.qk_norm,
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling,
        max_position_embeddings=config.max_position_embeddings,
        model_type=config.model_type,
        experts=ExpertShape.of(config),
        family_fields=tuple(config.family_fields.items()),
        model=config,
        config=source,
    )


def from_config(config: Mapping[str, Any], name: str | None = None) -> ModelShape:
    """A ModelShape from a Hugging Face config dict of a supported family (read into a ``ModelConfig``)."""
    label = name or (str(config.get("_name_or_path") or config.get("model_type", registry.DEFAULT_MODEL_TYPE))
                     if isinstance(config, Mapping) else "config")
    try:
        model = ModelConfig(**hf_config.fields(config))
    except ConfigError as e:
        raise ModelShapeError(f"{label}: {e}") from None
    return of_model(model, label, dict(config))


def from_config_file(path: str) -> ModelShape:
    """A ModelShape from a config.json path (or a folder that holds one)."""
    p = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(p):
        raise ModelShapeError(f"no model config at {p}; pass a preset name ({', '.join(PRESETS)}) "
                              "or a config.json path")
    try:
        data = hf_config.read_config_json(p)
    except hf_config.HFConfigError as e:
        raise ModelShapeError(str(e)) from None
    return from_config(data, name=os.path.basename(os.path.dirname(os.path.abspath(p))) or p)


# ---- presets: the numbers of each model's published config.json, from the families ----------------------

# A preset is a published model's shape, trained from random weights: its name says so ("shape:Qwen2.5-0.5B"),
# so that nobody takes it for the published weights (a Hub name, org/name, is those). The one place the rule is.
SHAPE_PREFIX = "shape:"
PRESETS: dict[str, ModelShape] = {SHAPE_PREFIX + p.name: from_config(p.config, name=SHAPE_PREFIX + p.name)
                                  for f in registry.families() for p in f.presets}


class BarePresetName(ModelShapeError):
    """A preset's name without ``shape:`` (its name before presets were marked as shapes)."""

    def __init__(self, model: str, preset: str) -> None:
        self.preset = preset  # the preset's name, shape: included
        super().__init__(f"{model!r} is now {preset} (the published shape with random weights, not the published "
                         f"weights); pass --model {preset}")


def resolve(model: str | Mapping[str, Any] | ModelShape) -> ModelShape:
    """A preset name (``shape:NAME``, case-insensitive), a config.json path, a config dict, or a ModelShape."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, Mapping):
        return from_config(model)
    by_lower = {k.lower(): v for k, v in PRESETS.items()}
    if model.lower() in by_lower:
        return by_lower[model.lower()]
    if (SHAPE_PREFIX + model).lower() in by_lower and not os.path.exists(model):
        raise BarePresetName(model, by_lower[(SHAPE_PREFIX + model).lower()].name)
    if os.path.exists(model) or model.endswith(".json"):
        return from_config_file(model)
    raise ModelShapeError(f"unknown model {model!r}; valid: {', '.join(PRESETS)}, or a config.json path")


def params_label(n: int | float) -> str:
    """1.24B, 405M: a parameter count for tables."""
    if n >= 1e9:
        return f"{n / 1e9:.{1 if n >= 1e10 else 2}f}B"
    return f"{n / 1e6:.0f}M"

