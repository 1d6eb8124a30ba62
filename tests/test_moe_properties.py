"""The mixture-of-experts families against transformers under the plans megatrain may run them with: for a drawn
family (Mixtral, Qwen3-MoE, Qwen2-MoE with its shared expert, gpt-oss), micro-batch size, expert-group size,
attention sequence tile and MLP sequence tile, a tiny model of transformers' trains 3 fp32 AdamW steps with clipping as transformers' own model does under ``torch.optim.AdamW``
(``hf_reference.assert_matches_transformers``: logits, each step's loss, the weights after). A handful of examples
under the fast hypothesis profile, all of them under ``thorough``.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from hypothesis_budget import examples

transformers = pytest.importorskip("transformers")

from hf_reference import assert_matches_transformers  # noqa: E402
from megatrain.runtime import ModelConfig, Plan  # noqa: E402
import test_gpt_oss  # noqa: E402
import test_moe  # noqa: E402

FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss")
TILES = st.sampled_from([None, 3, 7, 20])  # under, and at, the 20 tokens of hf_reference's rows


@settings(max_examples=examples(25), deadline=None)
@given(family=st.sampled_from(FAMILIES), micro=st.integers(1, 3), group=st.sampled_from([None, 1, 2, 3]),
       attention_tile=TILES, mlp_tile=TILES)
def test_moe_families_train_like_transformers_under_any_plan(family: str, micro: int, group: int | None,
                                                             attention_tile: int | None,
                                                             mlp_tile: int | None) -> None:
    config, hf = test_gpt_oss._hf_model() if family == "gpt_oss" else test_moe._hf_model(family)
    plan = Plan(micro_batch_size=micro, loss_chunk_tokens=16, attention_tile_tokens=attention_tile,
                mlp_tile_tokens=mlp_tile, expert_group_size=group)
    assert_matches_transformers(config.vocab_size, hf, ModelConfig.from_hf(config.to_dict()), steps=3, plan=plan)
