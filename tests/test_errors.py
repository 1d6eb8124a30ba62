"""Bad input gets one clear line naming the field and the fix, never a deep traceback."""
from __future__ import annotations

import json

import pytest
import torch

from megatrain.runtime import (ConfigError, Engine, InputError, ModelConfig, OptimizerConfig, Plan, PlanError)

CONFIG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module")
def engine():
    e = Engine(CONFIG, OptimizerConfig(max_grad_norm=1.0), compute_dtype=torch.float32, device="cpu")
    yield e
    e.close()


def _one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"


IDS = torch.randint(0, 32, (2, 8))


@pytest.mark.parametrize("ids, labels, words", [
    (IDS[0], IDS[0], ["input_ids", "[batch, seq_len]"]),
    (IDS[None], IDS[None], ["input_ids", "[batch, seq_len]"]),
    (IDS.float(), IDS, ["input_ids", "dtype", "integer"]),
    (IDS, IDS.float(), ["labels", "dtype"]),
    (IDS, IDS[:, :4], ["labels", "shape", "must match"]),
    (IDS + 32, IDS, ["input_ids", "vocab_size=32", "tokenizer"]),
    (IDS - 50, IDS, ["input_ids", "vocab_size=32"]),
    (IDS, IDS + 40, ["labels", "-100"]),
    (IDS, torch.full_like(IDS, -100), ["no token to predict"]),
    (IDS[:, :1], IDS[:, :1], ["no token to predict"]),
    (IDS[:0], IDS[:0], ["empty"]),
    ("hello", IDS, ["input_ids", "torch.Tensor"]),
])
def test_bad_batches(engine, ids, labels, words):
    before = engine.state_dict()
    with pytest.raises(InputError) as e:
        engine.step(ids, labels)
    _one_line(e, *words)
    after = engine.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a rejected batch changed the weights"


def test_bad_lr(engine):
    with pytest.raises(InputError) as e:
        engine.step(IDS, IDS, lr=-1.0)
    _one_line(e, "lr=-1.0")


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_slots=1), ["num_slots=1", ">= 2"]),
    (dict(num_slots=2, prefetch_depth=2), ["prefetch_depth=2", "num_slots"]),
    (dict(micro_batch_size=0), ["micro_batch_size=0"]),
    (dict(checkpoints="disk"), ["checkpoints='disk'", "'device'", "'host'"]),
    (dict(optimizer_mode="lazy"), ["optimizer_mode='lazy'", "'eager'"]),
    (dict(device_grad_buffers=1), ["device_grad_buffers=1"]),
    (dict(loss_chunk_tokens=0), ["loss_chunk_tokens=0"]),
    (dict(version=99), ["version 99", "megatrain-plan"]),
    (dict(kept_layers=(2, 2)), ["kept_layers=[2, 2]", "twice"]),
    (dict(kept_layers=(-1,)), ["kept_layers=(-1,)", "layer numbers"]),
])
def test_bad_plans(kwargs, words):
    with pytest.raises(PlanError) as e:
        Plan(**kwargs)
    _one_line(e, *words)
    with pytest.raises(PlanError) as e:  # a replace checks what it changes as a new plan would be checked
        Plan().replace(**kwargs)
    _one_line(e, *words)


def test_a_replace_normalizes_as_a_new_plan_does():
    assert Plan().replace(kept_layers=[3, 1]).kept_layers == (1, 3) == Plan(kept_layers=[3, 1]).kept_layers
    assert Plan().replace(kept_layers=[3, 1]) == Plan(kept_layers=(1, 3))


def test_plan_json_round_trip_and_errors(tmp_path):
    plan = Plan(num_slots=3, prefetch_depth=2, checkpoints="host")
    assert Plan.from_json(plan.to_json()) == plan
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert Plan.load(str(path)) == plan
    for text, words in [("{", ["not valid JSON"]), ("[]", ["JSON object"]),
                        (json.dumps({"version": 1, "slots": 2}), ["unknown plan field", "slots", "num_slots"]),
                        (json.dumps({"num_slots": 2}), ["no 'version'"])]:
        with pytest.raises(PlanError) as e:
            Plan.from_json(text)
        _one_line(e, *words)
    with pytest.raises(PlanError) as e:
        Plan.load(str(tmp_path / "missing.json"))
    _one_line(e, "cannot read plan file")


def test_eager_plan_refuses_clipping():
    with pytest.raises(PlanError) as e:
        Engine(CONFIG, OptimizerConfig(max_grad_norm=1.0), plan=Plan(optimizer_mode="eager"), device="cpu")
    _one_line(e, "optimizer_mode='eager'", "max_grad_norm=None", "deferred")


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_attention_heads=6, num_key_value_heads=4), ["num_attention_heads=6", "num_key_value_heads=4", "divisors"]),
    (dict(hidden_size=20, num_attention_heads=3, num_key_value_heads=1), ["hidden_size=20", "head_dim"]),
    (dict(vocab_size=0), ["vocab_size=0"]),
    (dict(head_dim=5), ["head_dim=5", "even"]),
    (dict(model_type="gpt2"), ["model_type='gpt2'", "llama"]),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 4.0}), ["'longrope'", "yarn"]),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), ["low_freq_factor"]),
])
def test_bad_model_configs(kwargs, words):
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ConfigError) as e:
        ModelConfig(**{**base, **kwargs})
    _one_line(e, *words)


@pytest.mark.parametrize("kwargs, words", [
    (dict(lr=-1), ["lr=-1"]),
    (dict(betas=(0.9, 1.5)), ["betas"]),
    (dict(eps=0), ["eps=0"]),
    (dict(max_grad_norm=0), ["max_grad_norm=0", "None"]),
])
def test_bad_optimizer_configs(kwargs, words):
    with pytest.raises(ConfigError) as e:
        OptimizerConfig(**kwargs)
    _one_line(e, *words)


def test_bad_engine_arguments():
    with pytest.raises(ConfigError) as e:
        Engine(CONFIG, compute_dtype=torch.float16, device="cpu")
    _one_line(e, "compute_dtype", "bfloat16", "float32")
    with pytest.raises(ConfigError) as e:
        Engine({"vocab_size": 3}, device="cpu")  # type: ignore[arg-type]
    _one_line(e, "ModelConfig")
    with pytest.raises(ConfigError) as e:
        Engine(CONFIG, device="tpu")
    _one_line(e, "device")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError) as e:
            Engine(CONFIG, device="cuda")
        _one_line(e, "no CUDA")


def test_bad_hf_configs(tmp_path):
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(tmp_path)
    _one_line(e, "no config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf(tmp_path)
    _one_line(e, "not valid JSON")
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf({"model_type": "gpt2", "vocab_size": 3})
    _one_line(e, "model_type='gpt2'", "supported")
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf({"model_type": "llama", "vocab_size": 3})
    _one_line(e, "hidden_size")


def test_bad_state_dict(engine):
    sd = engine.state_dict()
    broken = dict(sd)
    del broken["model.norm.weight"]
    with pytest.raises(InputError) as e:
        engine.load_state_dict(broken)
    _one_line(e, "missing", "model.norm.weight")
    broken = dict(sd, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(InputError) as e:
        engine.load_state_dict(broken)
    _one_line(e, "model.norm.weight", "shape")
    broken = dict(sd, extra=torch.ones(3))
    with pytest.raises(InputError) as e:
        engine.load_state_dict(broken)
    _one_line(e, "unexpected", "extra")
