"""Fuzz the Python API with generated bad input: a one-line MegatrainError or success, nothing else, ever.

Drives ModelConfig, OptimizerConfig, Plan, the Engine constructor, ``step`` inputs and the save / load paths.
Whatever the input, no file that existed before changes. Tiny models and modest example counts keep it fast.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatrain.runtime import Engine, MegatrainError, ModelConfig, OptimizerConfig, Plan

BASE = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2)
CONFIG = ModelConfig(**BASE)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

junk = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 0, -1, 0.5, 1.0, 2**63, "1e-6", "", "auto",
                     "a\0b", (0.9,), (0.9, 0.999, 0.5), [], {}, {"rope_type": "llama3"}, object()]),
    st.text(max_size=6), st.lists(st.integers(-3, 3), max_size=3), st.tuples(st.floats(), st.floats()),
)


def _expect_refusal_or_success(fn):
    """fn()'s result, or None when it raised a one-line MegatrainError; anything else fails the test."""
    try:
        return fn()
    except MegatrainError as e:
        msg = str(e)
        assert msg and "\n" not in msg, repr(msg)
        return None


def _finite_numbers(obj) -> bool:
    return all(math.isfinite(v) for v in vars(obj).values() if isinstance(v, float))


@FAST
@given(st.dictionaries(st.sampled_from(sorted(ModelConfig.__dataclass_fields__)), junk, min_size=1, max_size=3))
def test_model_config(changes) -> None:
    config = _expect_refusal_or_success(lambda: ModelConfig(**{**BASE, **changes}))
    if config is not None:
        assert _finite_numbers(config) and config.rms_norm_eps > 0 and config.rope_theta > 0
        assert config.sliding_window is None or config.sliding_window >= 1


@FAST
@given(st.dictionaries(st.sampled_from(sorted(OptimizerConfig.__dataclass_fields__)), junk, min_size=1, max_size=3))
def test_optimizer_config(changes) -> None:
    opt = _expect_refusal_or_success(lambda: OptimizerConfig(**changes))
    if opt is not None:
        assert _finite_numbers(opt) and opt.lr >= 0 and opt.eps > 0 and opt.weight_decay >= 0
        assert all(0 <= b < 1 and math.isfinite(b) for b in opt.betas)


@FAST
@given(st.dictionaries(st.sampled_from(sorted(Plan.__dataclass_fields__)), junk, max_size=3), st.one_of(junk, st.text()))
def test_plan(changes, text) -> None:
    _expect_refusal_or_success(lambda: Plan(**changes))
    _expect_refusal_or_success(lambda: Plan.from_dict(changes))
    if isinstance(text, str):
        _expect_refusal_or_success(lambda: Plan.from_json(text))


@FAST
@given(st.fixed_dictionaries({}, optional={"model_config": junk, "optimizer": junk, "plan": junk,
                                           "compute_dtype": st.one_of(junk, st.sampled_from([torch.float16, torch.int8])),
                                           "device": st.one_of(junk, st.sampled_from(["cuda", "meta", "cpu:0", "tpu"])),
                                           "seed": junk}))
def test_engine_constructor(kwargs) -> None:
    kwargs = {"model_config": CONFIG, "compute_dtype": torch.float32, "device": "cpu", **kwargs}
    engine = _expect_refusal_or_success(lambda: Engine(**kwargs))
    if engine is not None:
        engine.close()


@pytest.fixture(scope="module", autouse=True)
def _in_a_scratch_directory(tmp_path_factory):
    """Generated relative paths (``"auto"``, ``"1e-6"``) land in a scratch directory, not in the checkout."""
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("fuzz-cwd"))
    yield
    os.chdir(cwd)


@pytest.fixture(scope="module")
def engine():
    e = Engine(CONFIG, compute_dtype=torch.float32, device="cpu")
    yield e
    e.close()


tensors = st.tuples(
    st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple),
    st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.float32, torch.bool]),
    st.integers(-200, 200),
).map(lambda t: torch.full(t[0], t[2]).to(t[1]))


@settings(max_examples=40, deadline=None)
@given(st.one_of(tensors, junk), st.one_of(tensors, junk), st.one_of(st.none(), junk))
def test_step_inputs(engine, ids, labels, lr) -> None:
    before = engine.state_dict()
    loss = _expect_refusal_or_success(lambda: engine.step(ids, labels, lr=lr))
    after = engine.state_dict()
    if loss is None:
        assert all(torch.equal(before[k], after[k]) for k in before), "a refused step changed the weights"
    else:
        assert all(bool(torch.isfinite(t).all()) for t in after.values())


runs = st.lists(st.integers(1, 5), min_size=1, max_size=5)  # document lengths: valid rows, cut or spliced below


@pytest.fixture(scope="module")
def packed_engine():
    """Its own engine: these steps succeed (the shared engine's step count names the checkpoints below)."""
    e = Engine(CONFIG, compute_dtype=torch.float32, device="cpu")
    yield e
    e.close()


@settings(max_examples=40, deadline=None)
@given(st.one_of(tensors, junk, st.lists(st.lists(st.integers(-2, 6), min_size=6, max_size=6), min_size=2,
                                         max_size=2).map(torch.tensor),
                 st.tuples(runs, runs).map(lambda r: torch.stack([torch.cat([torch.arange(n) for n in row])[:6]
                                                                  for row in r]) if all(sum(x) >= 6 for x in r)
                                           else torch.zeros(2, 6, dtype=torch.long))))
def test_step_position_ids(packed_engine, position_ids) -> None:
    engine = packed_engine
    ids = torch.arange(12).reshape(2, 6) % CONFIG.vocab_size
    before = engine.state_dict()
    loss = _expect_refusal_or_success(lambda: engine.step(ids, ids, position_ids=position_ids))
    after = engine.state_dict()
    if loss is None:
        assert all(torch.equal(before[k], after[k]) for k in before), "a refused step changed the weights"
    else:
        assert all(bool(torch.isfinite(t).all()) for t in after.values())
    _expect_refusal_or_success(lambda: engine.logits(ids, position_ids=position_ids))


def _snapshot(root) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            full = os.path.join(dirpath, n)
            with open(full, "rb") as f:
                out[full] = f.read()
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory, engine):
    root = tmp_path_factory.mktemp("fuzz-files")
    (root / "user.txt").write_text("the user's own file")
    engine.save_checkpoint(root / "run", blocking=True)
    engine.save_pretrained(root / "hf")
    (root / "run" / "step-00000000" / "notes.txt").write_text("kept")
    return root


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_save_and_load_paths(engine, files, data) -> None:
    root = files
    path = data.draw(st.one_of(
        junk,
        st.sampled_from([root / "user.txt", root / "user.txt" / "sub", "/proc/megatrain-fuzz", root / "a\0b",
                         root / "run" / "step-00000000" / "notes.txt", root / "missing", root / "hf" / "config.json",
                         root / "run" / "latest", ""]),
    ))
    before = _snapshot(root)
    action = data.draw(st.sampled_from(["save_checkpoint", "save_pretrained", "load_checkpoint", "from_pretrained"]))
    if action == "save_checkpoint":
        _expect_refusal_or_success(lambda: engine.save_checkpoint(path, keep=data.draw(st.one_of(st.integers(1, 3), junk))))
        _expect_refusal_or_success(engine.wait_for_checkpoint)
    elif action == "save_pretrained":
        _expect_refusal_or_success(lambda: engine.save_pretrained(path, max_shard_bytes=data.draw(
            st.one_of(st.just(5 * 10**9), junk))))
    elif action == "load_checkpoint":
        loaded = _expect_refusal_or_success(lambda: Engine.load_checkpoint(path, device="cpu"))
        if loaded is not None:
            loaded.close()
    else:
        loaded = _expect_refusal_or_success(lambda: Engine.from_pretrained(path, device="cpu"))
        if loaded is not None:
            loaded.close()
    after = _snapshot(root)
    assert {k: v for k, v in after.items() if k in before} == before, "an existing file changed"
