"""The step's load sequences, as data, against the sequence the block-major design asks for."""
from __future__ import annotations

import pytest

from megatrain.runtime import ModelConfig
from megatrain.runtime.pipeline.step_schedule import evaluation_schedule, training_schedule
from megatrain.runtime.model.templates import Templates


def _templates(layers: int, tied: bool) -> Templates:
    config = ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    return Templates(config, decays=lambda name: True)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layers", [1, 3])
def test_training_sequence(layers: int, tied: bool) -> None:
    t = _templates(layers, tied)
    s = training_schedule(t)
    head = layers + 1
    fwd = [(0, "fwd")] + [(b, "fwd") for b in range(1, head)] + [(head, "fwd")] + ([(0, "fwd")] if tied else [])
    bwd = [(b, "bwd") for b in range(layers, 0, -1)]
    assert [(load.block.index, load.phase) for load in s.loads] == fwd + bwd
    assert [load.index for load in s.loads] == list(range(len(fwd) + len(bwd)))
    # Layers carry their decoder layer number (their activation checkpoints); the rest none.
    assert [load.layer for load in s.layers] == list(range(layers))
    assert [load.layer for load in s.backward] == list(range(layers - 1, -1, -1))
    assert s.embed.layer == -1 and all(load.layer == -1 for load in s.head_loads)
    # Backward loads wait for the last forward layer's release (every checkpoint saved); forward ones for nothing.
    assert all(load.after == s.layers[-1].index for load in s.backward)
    assert all(load.after is None for load in (s.embed, *s.layers, *s.head_loads))
    assert s.tied == tied
    assert s.lm_weight_name == ("embed_tokens.weight" if tied else "lm_head.weight")
    assert s.lm_weight_name in {e.local_name for e in s.head_loads[-1].block.layout.entries}
    # The order AdamW updates the blocks in: eager as their gradients drain, deferred in forward order.
    assert s.update_order(eager=True) == (head, *range(layers, 0, -1), 0)
    assert s.update_order(eager=False) == tuple(range(head + 1))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_evaluation_is_the_forward_part(tied: bool) -> None:
    t = _templates(2, tied)
    train, evaluation = training_schedule(t), evaluation_schedule(t)
    assert evaluation.backward == ()
    assert evaluation.loads == train.loads[:len(evaluation.loads)]
    assert (evaluation.head_loads, evaluation.lm_weight_name) == (train.head_loads, train.lm_weight_name)
