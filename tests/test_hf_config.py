"""The one config.json reader: every field honoured as transformers honours it, or refused in one line.

The runtime (``ModelConfig.from_hf``) and the planner (``model_shapes.from_config``) read through
``models/hf_config.py``; the families' parameter tables (``megatrain.models``) are checked here against
the parameters transformers' own modules and megatrain's templates register.
"""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatrain.models import hf_config
from megatrain.models.parameters import embedding_parameters, head_parameters, layer_parameters
from megatrain.planner.shapes import model_shapes
from megatrain.planner.shapes.model_shapes import ModelShapeError
from megatrain.runtime import ConfigError, ModelConfig
from megatrain.runtime.model.templates import BlockKind, Templates

BASE = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def _cfg(**extra: object) -> dict[str, object]:
    return {**BASE, **extra}


def _refused_by_both(config: dict, *words: str) -> None:
    """Both readers refuse ``config`` with one line holding ``words``; never another exception type."""
    with pytest.raises(ConfigError) as rt:
        ModelConfig.from_hf(config)
    with pytest.raises(ModelShapeError) as pl:
        model_shapes.from_config(config)
    for e in (rt, pl):
        msg = str(e.value)
        assert "\n" not in msg, msg
        for w in words:
            assert w in msg, f"{w!r} not in {msg!r}"


# ---- wrong JSON types: one line naming the field, never a bare TypeError ---------------------------------

@pytest.mark.parametrize("extra, words", [
    (dict(rms_norm_eps=None), ["rms_norm_eps=None", "number"]),
    (dict(rms_norm_eps="1e-6"), ["rms_norm_eps='1e-6'", "number", "string"]),
    (dict(rope_scaling={**LLAMA3, "factor": "8"}), ["rope_scaling.factor='8'", "number"]),
    (dict(rope_parameters={**LLAMA3, "rope_theta": 5e5, "low_freq_factor": None}), ["low_freq_factor=None"]),
    (dict(rope_theta="10000"), ["rope_theta='10000'"]),
    (dict(rope_scaling="linear"), ["rope_scaling='linear'", "object"]),
    (dict(hidden_size="32"), ["hidden_size='32'", "integer"]),
    (dict(hidden_size=32.0), ["hidden_size=32.0", "integer"]),
    (dict(num_key_value_heads="2"), ["num_key_value_heads='2'"]),
    (dict(head_dim=8.5), ["head_dim=8.5"]),
    (dict(tie_word_embeddings="false"), ["tie_word_embeddings='false'", "true or false"]),
    (dict(attention_bias=1), ["attention_bias=1"]),
    (dict(mlp_bias="no"), ["mlp_bias='no'"]),
    (dict(max_position_embeddings=None), ["max_position_embeddings=None"]),
    (dict(pad_token_id=1.5), ["pad_token_id=1.5"]),
    (dict(initializer_range=None), ["initializer_range=None"]),
    (dict(hidden_act=None), ["hidden_act=None"]),
    (dict(attention_dropout="0"), ["attention_dropout='0'"]),
    (dict(model_type="qwen2", use_sliding_window="true", sliding_window=8), ["use_sliding_window='true'"]),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=None),
     ["max_window_layers=None"]),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window="8"), ["sliding_window='8'"]),
    (dict(model_type="mistral", sliding_window=4096.0), ["sliding_window=4096.0"]),
    (dict(model_type="qwen3", use_sliding_window=True, layer_types="sliding"), ["layer_types='sliding'"]),
    (dict(vocab_size=None), ["vocab_size"]),
])
def test_wrong_json_types_are_one_line_naming_the_field(extra, words) -> None:
    _refused_by_both(_cfg(**extra), *words)


def test_wrong_type_in_a_config_file_names_the_file(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_cfg(rms_norm_eps="1e-6")))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(tmp_path)
    assert str(tmp_path) in str(e.value) and "rms_norm_eps='1e-6'" in str(e.value)
    with pytest.raises(ModelShapeError, match="rms_norm_eps"):
        model_shapes.resolve(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a config object"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match="UTF-8"):
        ModelConfig.from_hf(tmp_path)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=6)
FIELDS = sorted(set(BASE) | {"head_dim", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
                             "partial_rotary_factor", "tie_word_embeddings", "attention_bias", "mlp_bias",
                             "o_proj_bias", "qk_norm", "sliding_window", "use_sliding_window", "max_window_layers",
                             "layer_types", "attention_dropout", "max_position_embeddings", "pad_token_id",
                             "initializer_range"})


@given(model_type=st.sampled_from(hf_config.SUPPORTED_MODEL_TYPES),
       edits=st.dictionaries(st.sampled_from(FIELDS), JSON, min_size=1, max_size=3))
def test_any_json_value_in_any_field_reads_or_is_refused_in_one_line(model_type: str, edits: dict) -> None:
    config = {**_cfg(model_type=model_type), **edits}
    for read, error in ((ModelConfig.from_hf, ConfigError), (model_shapes.from_config, ModelShapeError)):
        try:
            read(config)
        except error as e:
            assert "\n" not in str(e) and str(e)


# ---- fields honoured, or refused by name --------------------------------------------------------------

@pytest.mark.parametrize("extra, words", [
    (dict(hidden_act="gelu_new"), ["hidden_act='gelu_new'", "silu", "gelu_pytorch_tanh", "relu"]),
    (dict(hidden_act="tanh"), ["hidden_act='tanh'"]),
    (dict(attention_dropout=0.1), ["attention_dropout=0.1", "0.0"]),
    (dict(partial_rotary_factor=0.5), ["partial_rotary_factor=0.5"]),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}),
     ["partial_rotary_factor=0.25"]),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 4.0}), ["'longrope'", "yarn"]),
    (dict(rope_parameters={"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}),
     ["per layer type"]),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), ["low_freq_factor", "high_freq_factor"]),
    (dict(model_type="gpt2"), ["model_type='gpt2'"]),
    (dict(model_type="qwen2", attention_bias=False), ["attention_bias=false", "qwen2", "always"]),
    (dict(model_type="mistral", attention_bias=True), ["attention_bias=true", "mistral", "never"]),
    (dict(model_type="qwen3", mlp_bias=True), ["mlp_bias=true", "qwen3"]),
    (dict(model_type="qwen2", mlp_bias=True), ["mlp_bias=true", "qwen2"]),
    (dict(model_type="llama", qk_norm=True), ["qk_norm=True", "llama"]),
    (dict(model_type="qwen2", o_proj_bias=True), ["o_proj_bias=true", "qwen2"]),
])
def test_unsupported_fields_are_refused_by_name(extra, words) -> None:
    _refused_by_both(_cfg(**extra), *words)


def test_activations_are_read() -> None:
    for act in hf_config.SUPPORTED_ACTIVATIONS:
        assert ModelConfig.from_hf(_cfg(hidden_act=act)).hidden_act == act
    assert ModelConfig.from_hf(_cfg()).hidden_act == "silu"
    with pytest.raises(ConfigError, match="hidden_act='quick_gelu'"):
        ModelConfig(**{**ModelConfig.from_hf(_cfg()).to_dict(), "hidden_act": "quick_gelu"})


def test_direct_model_config_types_are_one_line() -> None:
    base = ModelConfig.from_hf(_cfg()).to_dict()
    for field, value in (("rms_norm_eps", None), ("rms_norm_eps", "1e-6"), ("rope_theta", "1e4"),
                         ("pad_token_id", "0"), ("sliding_window", "8"), ("attention_bias", "yes"),
                         ("rope_scaling", {"rope_type": "linear", "factor": "2"}), ("initializer_range", None)):
        with pytest.raises(ConfigError) as e:
            ModelConfig(**{**base, field: value})
        assert field in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("model_type, extra, window", [
    # Qwen3 / Qwen2: the window applies only with use_sliding_window, and only to layers >= max_window_layers.
    ("qwen3", dict(use_sliding_window=False, sliding_window=8), None),
    ("qwen3", dict(sliding_window=8), None),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0), 8),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), 8),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2), None),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8), None),  # max_window_layers 28 > 2 layers
    ("qwen3", dict(use_sliding_window=True, sliding_window=None, max_window_layers=0), None),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, layer_types=["full_attention"] * 2), None),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, layer_types=["full_attention", "sliding_attention"]),
     8),
    ("qwen3", dict(use_sliding_window=False, sliding_window=8, layer_types=["sliding_attention"] * 2), None),
    ("qwen2", dict(use_sliding_window=False, sliding_window=8), None),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=0), 8),
    # Mistral: sliding_window on every layer; absent means transformers' default 4096, null means none.
    ("mistral", dict(sliding_window=8), 8),
    ("mistral", dict(sliding_window=None), None),
    ("mistral", dict(), 4096),
    # Llama has no window in transformers.
    ("llama", dict(sliding_window=8, use_sliding_window=True), None),
])
def test_sliding_window_rules(model_type: str, extra: dict, window: int | None) -> None:
    assert ModelConfig.from_hf(_cfg(model_type=model_type, **extra)).sliding_window == window


def test_family_defaults_follow_transformers() -> None:
    q3 = ModelConfig.from_hf(_cfg(model_type="qwen3"))
    assert q3.head_dim == 128 and q3.qk_norm and not q3.attention_bias
    q2 = ModelConfig.from_hf(_cfg(model_type="qwen2"))
    assert q2.attention_bias and not q2.o_proj_bias and not q2.mlp_bias
    assert ModelConfig.from_hf(_cfg(model_type="qwen2", attention_bias=True)).attention_bias
    llama = ModelConfig.from_hf(_cfg(attention_bias=True, mlp_bias=True))
    assert llama.attention_bias and llama.o_proj_bias and llama.mlp_bias and llama.head_dim == 8
    assert ModelConfig.from_hf(_cfg(head_dim=None)).head_dim == 8
    assert ModelConfig.from_hf(_cfg(num_key_value_heads=None)).num_key_value_heads == 4
    # llama3 RoPE without original_max_position_embeddings: transformers takes max_position_embeddings.
    scaling = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    c = ModelConfig.from_hf(_cfg(max_position_embeddings=64, rope_parameters={"rope_theta": 5e5, **scaling}))
    assert c.rope_scaling["original_max_position_embeddings"] == 64 and c.rope_theta == 5e5
    # Both spellings present: rope_scaling is used, as transformers does.
    c = ModelConfig.from_hf(_cfg(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=100.0,
                                 rope_parameters={"rope_type": "default", "rope_theta": 7.0}))
    assert dict(c.rope_scaling) == {"rope_type": "linear", "factor": 2.0} and c.rope_theta == 100.0
    assert ModelConfig.from_hf(_cfg(partial_rotary_factor=1.0)).rope_scaling is None


@pytest.mark.parametrize("model_type", hf_config.SUPPORTED_MODEL_TYPES)
def test_model_config_dict_reads_back_as_the_same_model(model_type: str) -> None:
    """``ModelConfig.to_dict()`` (what checkpoints and ``megatrain-train`` hand the planner) reads back the same."""
    window = 8 if model_type == "gemma3_text" else None  # Gemma 3's sliding layers need one
    c = ModelConfig.from_hf(_cfg(model_type=model_type, tie_word_embeddings=True, hidden_act="gelu",
                                 rope_scaling=LLAMA3, pad_token_id=3, sliding_window=window))
    assert ModelConfig.from_hf(c.to_dict()) == c
    a, b = model_shapes.from_config(c.to_dict()), model_shapes.from_config(_cfg(model_type=model_type,
                                                                                tie_word_embeddings=True))
    assert (a.params, a.numel_total, a.qk_norm, a.o_proj_bias) == (b.params, b.numel_total, b.qk_norm, b.o_proj_bias)


# ---- one parameter table: transformers' modules, megatrain's templates and the planner agree ----------------

TABLE_CASES = {
    "llama": dict(model_type="llama"),
    "llama-bias-tied": dict(model_type="llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2"),
    "qwen3-bias": dict(model_type="qwen3", head_dim=12, attention_bias=True),
    "mistral-tied": dict(model_type="mistral", head_dim=6, tie_word_embeddings=True, sliding_window=None),
}


@pytest.mark.parametrize("name", sorted(TABLE_CASES))
def test_parameter_table_is_what_transformers_and_the_templates_register(name: str) -> None:
    transformers = pytest.importorskip("transformers")
    hf = _cfg(**TABLE_CASES[name])
    c = ModelConfig.from_hf(hf)
    table = {
        BlockKind.EMBED: embedding_parameters(vocab_size=c.vocab_size, hidden_size=c.hidden_size),
        BlockKind.LAYER: layer_parameters(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                                          num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                                          head_dim=c.head_dim, attention_bias=c.attention_bias,
                                          o_proj_bias=c.o_proj_bias, mlp_bias=c.mlp_bias, qk_norm=c.qk_norm),
        BlockKind.HEAD: head_parameters(hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                                        tie_word_embeddings=c.tie_word_embeddings),
    }
    # megatrain's templates: what their modules really register, in order.
    templates = Templates(c, lambda _: True)
    for kind, module in templates.modules.items():
        assert [(n, tuple(p.shape)) for n, p in module.named_parameters()] == [(p.name, p.shape) for p in table[kind]]
    # transformers: the same names, shapes and order as model.parameters().
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hf))
    theirs = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    ours = [(e.hf_name, e.shape) for b in templates.blocks for e in b.layout.entries]
    assert ours == theirs
    # the planner: counts and aligned sizes from the same table.
    shape = model_shapes.from_config(hf)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.layer_params() == [p.numel for p in table[BlockKind.LAYER]]
    assert shape.numel_layer == templates.layers[0].layout.numel
    assert shape.numel_embedding == templates.embed.layout.numel and shape.numel_head == templates.head.layout.numel


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_conflicting_expert_counts_are_refused(model_type: str) -> None:
    """num_experts and num_local_experts both given and different: which one a reader takes differs by family."""
    config = _cfg(model_type=model_type, num_experts=0, num_local_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=24)
    _refused_by_both(config, "num_experts=0 and num_local_experts=4 disagree", model_type)
    agreeing = {**config, "num_experts": 4}
    assert ModelConfig.from_hf(agreeing).num_experts == 4  # the agreeing pair: 4 experts
