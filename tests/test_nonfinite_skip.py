"""OptimizerConfig(skip_nonfinite=True): a non-finite gradient skips the update and says so; off, NaN spreads.
Weights holding NaN or infinity are refused where a model is loaded and where one is exported.

See [Note: non-finite updates] in runtime/optim/cpu_adamw.py.
"""
from __future__ import annotations

import os

import pytest
import torch

from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan
from megatrain.runtime.errors import NonFiniteError

CONFIG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2)
IDS = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
MODES = [("deferred", 1.0), ("deferred", None), ("eager", None)]


def _bits(state: dict) -> dict:
    """Tensors as their bit patterns: NaN compares equal to itself."""
    out = {}
    for name, value in state.items():
        if isinstance(value, dict):
            out.update({f"{name}.{k}": v.view(torch.int32).clone() for k, v in value.items()})
        else:
            out[name] = value.view(torch.int32).clone()
    return out


def _poisoned(engine: Engine) -> dict:
    """The engine's weights with one lm_head row set to NaN: every logit, the loss and every gradient go NaN."""
    state = engine.state_dict()
    state["lm_head.weight"] = state["lm_head.weight"].clone()
    state["lm_head.weight"][5] = float("nan")
    return state


@pytest.mark.parametrize("resident", [(), (0, 2), (0, 1, 2, 3)], ids=["host", "some-resident", "all-resident"])
@pytest.mark.parametrize("mode, clip", MODES)
def test_nonfinite_gradient_skips_the_update(mode, clip, resident) -> None:
    """In host RAM, and with some or every block's state on the device ([Note: non-finite updates on the device])."""
    opt = OptimizerConfig(lr=1e-2, max_grad_norm=clip, skip_nonfinite=True)
    plan = Plan(optimizer_mode=mode, resident_blocks=resident)
    with Engine(CONFIG, opt, plan=plan, compute_dtype=torch.float32, device="cpu") as engine:
        engine.step(IDS, IDS)
        good = engine.state_dict()
        engine.load_state_dict(_poisoned(engine))
        before = (_bits(engine.state_dict()), _bits(engine.optimizer_state_dict()))
        loss = engine.step(IDS, IDS)
        assert not torch.isfinite(loss)
        with pytest.warns(RuntimeWarning, match=r"step 2: the gradient is not finite.*skipped"):
            engine.synchronize()
        assert engine.skipped_steps == [2]
        after = (_bits(engine.state_dict()), _bits(engine.optimizer_state_dict()))
        for a, b in zip(after, before):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "a skipped update changed state"
        engine.load_state_dict(good)  # the cause is gone: training goes on
        engine.step(IDS, IDS)
        engine.synchronize()
        state = engine.optimizer_state_dict()
        assert all(bool(torch.isfinite(t).all()) for t in engine.state_dict().values())
        assert all(float(s["step"]) == 2.0 for s in state.values())  # step 2 did not count


@pytest.mark.parametrize("mode, clip", MODES)
def test_without_the_flag_nan_reaches_the_masters(mode, clip) -> None:
    opt = OptimizerConfig(lr=1e-2, max_grad_norm=clip)
    with Engine(CONFIG, opt, plan=Plan(optimizer_mode=mode), compute_dtype=torch.float32, device="cpu") as engine:
        engine.load_state_dict(_poisoned(engine))
        engine.step(IDS, IDS)
        engine.synchronize()
        assert engine.skipped_steps == []
        assert not bool(torch.isfinite(engine.state_dict()["model.embed_tokens.weight"]).all())


def _saved(tmp_path, value: float, allow_nonfinite: bool = True) -> str:
    """A Hugging Face directory of CONFIG whose lm_head row 5 holds ``value`` (fp32 files)."""
    with Engine(CONFIG, compute_dtype=torch.float32, device="cpu") as engine:
        state = engine.state_dict()
        state["lm_head.weight"] = state["lm_head.weight"].clone()
        state["lm_head.weight"][5, 3] = value
        engine.load_state_dict(state)
        engine.save_pretrained(tmp_path / "model", dtype=torch.float32, allow_nonfinite=allow_nonfinite)
    return str(tmp_path / "model")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_model_with_a_non_finite_weight_is_refused_at_load_naming_the_tensor(tmp_path, value) -> None:
    path = _saved(tmp_path, value)
    with pytest.raises(NonFiniteError) as err:
        Engine.from_pretrained(path, compute_dtype=torch.float32, device="cpu")
    msg = str(err.value)
    assert "\n" not in msg and "lm_head.weight" in msg and "1 non-finite value" in msg, msg


def test_a_finite_model_loads_bit_for_bit(tmp_path) -> None:
    path = _saved(tmp_path, 3.0e38)  # finite, if absurd: loads (what it trains to is the run's concern)
    with Engine.from_pretrained(path, compute_dtype=torch.float32, device="cpu") as engine:
        assert float(engine.state_dict()["lm_head.weight"][5, 3]) == pytest.approx(3.0e38)


def test_save_pretrained_refuses_non_finite_weights_unless_allowed(tmp_path) -> None:
    with Engine(CONFIG, compute_dtype=torch.float32, device="cpu") as engine:
        engine.load_state_dict(_poisoned(engine))
        with pytest.raises(NonFiniteError) as err:
            engine.save_pretrained(tmp_path / "refused", dtype=torch.float32)
        assert "lm_head.weight" in str(err.value) and "\n" not in str(err.value)
        assert not any(n.endswith(".safetensors") or n.endswith(".tmp") for n in os.listdir(tmp_path / "refused"))
        big = engine.state_dict()  # finite in fp32, infinite once rounded to bf16: refused in bf16 only
        big["lm_head.weight"] = torch.full_like(big["lm_head.weight"], 3.4e38)
        engine.load_state_dict(big)
        engine.save_pretrained(tmp_path / "fp32", dtype=torch.float32)
        with pytest.raises(NonFiniteError, match="BF16"):
            engine.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
        engine.save_pretrained(tmp_path / "allowed", dtype=torch.bfloat16, allow_nonfinite=True)
        assert os.path.exists(tmp_path / "allowed" / "model.safetensors")
