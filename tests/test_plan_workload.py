"""A plan records the workload it was made for; the Engine refuses another model, dtype, or a larger step."""
from __future__ import annotations

import json

import pytest
import torch

from megatrain.planner.profiling import hardware
from megatrain.planner.shapes import model_shapes
from megatrain.planner.choice import search
from megatrain.plan.plan import Plan, PlanError
from megatrain.plan.workload_fingerprint import WorkloadFingerprint, shape_digest
from megatrain.planner.shapes.workload import Workload
from megatrain.runtime import Engine, ModelConfig, OptimizerConfig

HF = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": True}


def _planned(seq: int = 16, batch: int = 4, dtype: str = "fp32") -> Plan:
    shape = model_shapes.from_config(HF, name="tiny")
    return search.search(shape, Workload(seq, batch, dtype), hardware.preset("H100-SXM")).require().plan


def test_runtime_and_planner_agree_on_the_shape_digest() -> None:
    for hf in (HF, {**HF, "model_type": "qwen2"}, {**HF, "model_type": "qwen3", "head_dim": 16},
               {**HF, "tie_word_embeddings": True, "attention_bias": False}):
        shape = model_shapes.from_config(hf)
        planned = Workload(8, 1).fingerprint(shape).shape_digest
        assert planned == shape_digest(ModelConfig.from_hf(hf).to_dict()), hf
    assert len({Workload(8, 1).fingerprint(model_shapes.from_config(h)).shape_digest
                for h in (HF, {**HF, "num_hidden_layers": 3}, {**HF, "vocab_size": 65})}) == 3


def test_fingerprint_round_trips_and_old_plans_load(tmp_path) -> None:
    plan = _planned()
    assert plan.workload is not None and plan.workload.model == "tiny"
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert Plan.load(str(path)) == plan
    old = plan.to_dict()
    del old["workload"]                       # written before plans carried their workload
    assert Plan.from_dict(old).workload is None
    bad = {**plan.to_dict(), "workload": {"model": "x"}}
    with pytest.raises(PlanError, match="workload"):
        Plan.from_dict(bad)
    assert json.loads(plan.to_json())["workload"]["seq_len"] == 16


def test_check_workload_names_the_difference() -> None:
    fp = WorkloadFingerprint("tiny", 1000, "abc", seq_len=16, batch=4, compute_dtype="float32")
    plan = Plan(workload=fp)
    plan.check_workload("abc", 16, 4, "float32")
    plan.check_workload("abc", 8, 1, "float32")            # smaller steps need less memory
    for args, needle in ((("abd", 16, 4, "float32"), "tiny"), (("abc", 16, 4, "bfloat16"), "--dtype"),
                         (("abc", 32, 4, "float32"), "--seq-len 32"), (("abc", 16, 5, "float32"), "--batch 5")):
        with pytest.raises(PlanError, match=needle) as e:
            plan.check_workload(*args)
        assert "\n" not in str(e.value)
    Plan().check_workload("anything", 1 << 20, 1 << 20, "float16")   # hand-made: not checked


def test_engine_refuses_a_plan_for_another_workload() -> None:
    config = ModelConfig.from_hf(HF)
    opt = OptimizerConfig(max_grad_norm=1.0)
    plan = _planned(seq=16, batch=4, dtype="fp32")
    with pytest.raises(PlanError, match="compute dtype"):
        Engine(config, opt, plan=plan, compute_dtype=torch.bfloat16, device="cpu")
    other = ModelConfig.from_hf({**HF, "num_hidden_layers": 3})
    with pytest.raises(PlanError, match="made for tiny"):
        Engine(other, opt, plan=plan, compute_dtype=torch.float32, device="cpu")
    with Engine(config, opt, plan=plan, compute_dtype=torch.float32, device="cpu") as engine:
        ids = torch.randint(0, 64, (4, 16))
        engine.step(ids, ids)
        engine.step(ids[:2, :8], ids[:2, :8])                  # smaller: accepted
        with pytest.raises(PlanError, match="--seq-len 32"):
            engine.step(torch.cat([ids, ids], 1), torch.cat([ids, ids], 1))
        with pytest.raises(PlanError, match="--batch 8"):
            engine.step(torch.cat([ids, ids]), torch.cat([ids, ids]))
        assert engine.step_count == 2
