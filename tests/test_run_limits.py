"""Sizes are checked before work: a batch, a sequence or a token count no plan can hold is refused in one line
(status 2) naming what fits, before the data is packed and before --out is made; Engine.step refuses a batch
whose activations cannot fit before allocating it."""
from __future__ import annotations

import os

import pytest
import torch

from megatrain.plan.plan import Plan
from megatrain.runtime import Engine, ModelConfig
from megatrain.runtime.batch_limits import BatchTooLargeError
from megatrain.tools import data_order, train

FAST = ["--progress", "none", "--no-plot", "--steps", "2"]
HUGE = "99999999999999999999"


def _refused(tmp_path, capsys, argv, *fragments) -> str:
    out = tmp_path / "run"
    assert train.main(argv + ["--out", str(out)] + FAST) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatrain-train: error: ") and "Traceback" not in err, err
    assert all(f in err for f in fragments), err
    assert not out.exists()
    return err


@pytest.fixture
def no_packing(monkeypatch):
    """The data must not be read into batches: a refusal comes first."""
    def packed(*args, **kwargs):
        raise AssertionError("the data was packed before the sizes were checked")
    monkeypatch.setattr(data_order, "training_data", packed)


@pytest.mark.parametrize("seq", [HUGE, "1000000000"])
def test_a_sequence_no_machine_holds_is_one_line(tmp_path, capsys, no_packing, seq):
    _refused(tmp_path, capsys, ["--seq-len", seq], "no plan fits", "the longest sequence that fits is")


def test_a_huge_sequence_in_a_toml_file_is_one_line(tmp_path, capsys, no_packing):
    toml = tmp_path / "run.toml"
    toml.write_text(f"seq_len = {HUGE}\n")
    _refused(tmp_path, capsys, ["--config", str(toml)], "no plan fits", "the longest sequence that fits is")
    assert toml.read_text() == f"seq_len = {HUGE}\n"


def test_a_huge_batch_is_refused_before_packing_naming_the_largest_that_fits(tmp_path, capsys, no_packing):
    err = _refused(tmp_path, capsys, ["--batch", "1000000000"], "no plan fits", "the largest batch that fits at "
                   "--seq-len 256 is about ")
    largest = int(err.rsplit("(--batch ", 1)[1].split(")")[0])
    assert 1 <= largest < 10**9 and largest & (largest - 1) == 0  # a power of two


def test_a_given_plan_too_small_for_the_batch_is_refused(tmp_path, capsys, no_packing):
    plan = tmp_path / "plan.json"
    Plan(micro_batch_size=100000).save(str(plan))
    _refused(tmp_path, capsys, ["--plan", str(plan), "--batch", "100000", "--seq-len", "2048"],
             "the plan does not fit this step of 100000 x 2048 tokens", "the largest batch that fits")


@pytest.mark.parametrize("argv", [["--tokens", "0"], ["--tokens", "0", "--steps", "3"]])
def test_zero_tokens_is_refused(tmp_path, capsys, argv):
    _refused(tmp_path, capsys, argv, "tokens=0 trains nothing")


def test_zero_tokens_in_a_toml_file_is_refused(tmp_path, capsys):
    (tmp_path / "run.toml").write_text("tokens = 0\n")
    _refused(tmp_path, capsys, ["--config", str(tmp_path / "run.toml")], "tokens=0 trains nothing")


CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


@pytest.mark.parametrize("shape, fragment", [
    ((1, 10**10), "the longest row that fits is "),     # one row of ten billion tokens
    ((10**7, 2048), "row(s) of 2048 tokens fit at once"),
])
def test_engine_step_refuses_a_batch_that_cannot_fit_before_allocating_it(shape, fragment):
    ids = torch.zeros(1, 1, dtype=torch.int64).expand(*shape)  # a view: nothing of the batch is allocated
    with Engine(CONFIG, compute_dtype=torch.float32, device="cpu") as engine:
        before = engine.state_dict()
        with pytest.raises(BatchTooLargeError) as err:
            engine.step(ids, ids)
        msg = str(err.value)
        assert "\n" not in msg and "GiB of activations" in msg and fragment in msg, msg
        assert engine.step_count == 0 and all(torch.equal(before[k], v) for k, v in engine.state_dict().items())
        small = torch.randint(0, 64, (2, 16))
        engine.step(small, small)  # the engine is still usable: its first step opens the plan's micro-batch
        assert engine.step_count == 1


def test_engine_step_with_a_plan_refuses_its_micro_batch_too():
    ids = torch.zeros(1, 1, dtype=torch.int64).expand(4, 10**10)
    with Engine(CONFIG, plan=Plan(micro_batch_size=1), compute_dtype=torch.float32, device="cpu") as engine:
        with pytest.raises(BatchTooLargeError, match="the longest row that fits"):
            engine.step(ids, ids)
