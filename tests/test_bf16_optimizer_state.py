"""bf16 AdamW state ([Note: bf16 optimizer state]): stochastic rounding, training, exact resume, the planner's bytes."""
from __future__ import annotations

import pytest
import torch

from megatrain.planner.costs import memory_model
from megatrain.planner.shapes import model_shapes
from megatrain.planner.shapes.workload import Workload, WorkloadError
from megatrain.runtime import ConfigError, Engine, ModelConfig, OptimizerConfig, Plan
from megatrain.runtime.optim.stochastic_rounding import (NOISE_PERIOD, WIDEN_ELEMENTS, cache_chunk, noise_at,
                                                         noise_key, noise_table, round_stochastic,
                                                         widened_chunks)

CONFIG = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
PLAN = Plan(micro_batch_size=2, loss_chunk_tokens=16)


def optimizer(state_dtype: str) -> OptimizerConfig:
    return OptimizerConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=0.5, no_decay=("norm",),
                           state_dtype=state_dtype)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, CONFIG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(100 + step))
    return ids, ids.clone()


def engine(state_dtype: str, plan: Plan = PLAN) -> Engine:
    return Engine(CONFIG, optimizer(state_dtype), plan=plan, compute_dtype=torch.float32, device="cpu", seed=5)


def train(e: Engine, start: int, stop: int) -> list[float]:
    return [float(e.step(*batch(s % 2), lr=1e-2 / (1 + 0.1 * s))) for s in range(start, stop)]  # learnable


def state(e: Engine) -> dict[str, torch.Tensor]:
    e.synchronize()
    s = e.store
    return {"master": s.master.tensor.clone(), "exp_avg": s.exp_avg.tensor.clone(),
            "exp_avg_sq": s.exp_avg_sq.tensor.clone(), "steps": torch.stack(s.steps)}


def rounded(src: torch.Tensor, at: int) -> torch.Tensor:
    """src (fp32 [n]) rounded to bf16 with the noise from ``noise_table()[at]`` on (m's half of the table)."""
    dst = torch.empty(src.numel(), dtype=torch.bfloat16)
    round_stochastic(src.clone().view(1, -1), [dst], (at,))
    return dst


def test_noise_table_holds_every_16_bit_value_once_per_period() -> None:
    # exact balance: over a uniformly random offset, every element's noise is exactly uniform on [0, 2^16)
    table = noise_table()
    assert table.shape == (4 * NOISE_PERIOD,) and table.dtype == torch.int32
    for half in (0, 2):
        period = table[half * NOISE_PERIOD:(half + 1) * NOISE_PERIOD]
        assert torch.equal(period.sort().values, torch.arange(NOISE_PERIOD, dtype=torch.int32))
        assert torch.equal(table[(half + 1) * NOISE_PERIOD:(half + 2) * NOISE_PERIOD], period)
    assert not torch.equal(table[:NOISE_PERIOD], table[2 * NOISE_PERIOD:3 * NOISE_PERIOD])  # m's and v's differ
    # no visible pattern: neighbours uncorrelated, the low bit a fair coin (a plain counter would fail both)
    x = table[:NOISE_PERIOD].double()
    assert abs(float(torch.corrcoef(torch.stack([x[:-1], x[1:]]))[0, 1])) < 0.02
    assert abs(float((table[:NOISE_PERIOD] & 1).double().mean()) - 0.5) < 0.01


def test_stochastic_rounding_is_unbiased_where_nearest_is_not() -> None:
    # 1 + 2^-9 lies a quarter of a bf16 ULP (2^-7) above 1: round-to-nearest always gives 1.0 (bias -2^-9);
    # stochastic rounding gives 1 + 2^-7 a quarter of the time, 1.0 otherwise: the mean is the value itself.
    value = 1.0 + 2.0 ** -9
    draws = 200_000
    dst = torch.empty(draws, dtype=torch.bfloat16)
    at = noise_at(3, 1, 0)
    round_stochastic(torch.full((2, draws), value), [dst, torch.empty_like(dst)], at)
    assert set(dst.float().unique().tolist()) == {1.0, 1.0 + 2.0 ** -7}
    mean = float(dst.double().mean())
    nearest = float(torch.tensor(value).bfloat16().double())
    assert nearest == 1.0 and abs(nearest - value) == 2.0 ** -9
    # a whole period of noise holds every 16-bit value once: each of 3 periods rounds up exactly a quarter of
    # its 2^16 draws; the 3392-draw remainder's share up is within 5 standard errors of a quarter
    assert abs(mean - value) < 4e-5
    # negative values round the same way in magnitude, v's half of the table too
    v = torch.empty_like(dst)
    round_stochastic(torch.full((2, draws), -value), [dst, v], noise_at(4, 1, 0))
    assert abs(float(dst.double().mean()) + value) < 4e-5 and abs(float(v.double().mean()) + value) < 4e-5


def test_rounding_one_element_over_many_keys_is_unbiased() -> None:
    # the same element (block 2, element 70000) across 4000 AdamW steps: its noise comes from 4000 hashed
    # offsets; the mean of its roundings converges to the value (standard error 2^-7 x sqrt(0.3 x 0.7 / 4000))
    value = 1.0 + 0.3 * 2.0 ** -7
    ups = []
    for step in range(4000):
        m = rounded(torch.full((1,), value), noise_at(step, 2, 70_000)[0])
        ups.append(float(m[0]) > 1.0)
    share = sum(ups) / len(ups)
    assert abs(share - 0.3) < 5 * (0.3 * 0.7 / 4000) ** 0.5


def test_stochastic_rounding_is_deterministic_for_the_same_key() -> None:
    src = torch.randn(10_000)
    a = rounded(src, noise_at(7, 3, 1024)[0])
    b = rounded(src, noise_at(7, 3, 1024)[0])
    c = rounded(src, noise_at(8, 3, 1024)[0])
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(a.view(torch.int16), c.view(torch.int16))
    # every result is one of the two bf16 neighbours of its source (truncated, or that plus one ULP)
    down = (src.view(torch.int32) & -(1 << 16)).view(torch.float32)
    up = ((src.view(torch.int32) & -(1 << 16)) + (1 << 16)).view(torch.float32)
    assert bool(((a.float() == down) | (a.float() == up)).all())
    keys = {noise_key(s, b, o, w) for s in range(3) for b in range(3) for o in (0, WIDEN_ELEMENTS) for w in (0, 1)}
    assert len(keys) == 36  # distinct keys hash apart (2^16 offsets: a collision here would be 1 in ~100)


def test_chunked_rounding_does_not_depend_on_the_chunk_size() -> None:
    # a piece rounded in one chunk or in chunks of 2^17 (one per thread count) gets the same bits: the noise is
    # the piece's at each element's position, whatever the chunk that holds it
    n = 3 * 2**17 + 5000
    src = torch.randn(2, n)
    whole = [torch.empty(n, dtype=torch.bfloat16) for _ in range(2)]
    round_stochastic(src.clone(), whole, noise_at(5, 6, WIDEN_ELEMENTS))
    parts = [torch.empty(n, dtype=torch.bfloat16) for _ in range(2)]
    for a, k in widened_chunks(n, WIDEN_ELEMENTS, cache_chunk(1)):
        round_stochastic(src[:, a:a + k].clone(), [parts[0][a:a + k], parts[1][a:a + k]],
                         noise_at(5, 6, WIDEN_ELEMENTS + a))
    assert all(torch.equal(w.view(torch.int16), p.view(torch.int16)) for w, p in zip(whole, parts))
    # m's and v's noise differ: the same values round apart
    same = torch.full((2, n), 1.0 + 2.0 ** -9)
    round_stochastic(same, whole, noise_at(5, 6, 0))
    assert not torch.equal(whole[0].view(torch.int16), whole[1].view(torch.int16))


def test_bf16_state_tracks_fp32_state_losses() -> None:
    """30 steps of the tiny model on two alternating batches: the losses with bf16 m, v stay within 5e-4 (relative)
    of fp32 state's. Measured on torch 2.13 CPU: the largest relative difference over the 30 steps is 5.6e-5 (loss
    4.86 -> 2.44 both ways)."""
    with engine("fp32") as e:
        exact = train(e, 0, 30)
    with engine("bf16") as e:
        assert e.store.exp_avg.tensor.dtype == torch.bfloat16 == e.store.exp_avg_sq.tensor.dtype
        compact = train(e, 0, 30)
        assert e.store.master.tensor.dtype == torch.float32
    assert exact[-1] < exact[0] * 0.9  # it learns
    worst = max(abs(a - b) / a for a, b in zip(exact, compact))
    assert worst < 5e-4, worst


def test_bf16_state_resumes_bitwise(tmp_path) -> None:
    with engine("bf16") as straight:
        train(straight, 0, 6)
        expected = state(straight)
    with engine("bf16") as first:
        train(first, 0, 3)
        first.save_checkpoint(tmp_path, blocking=True)
    with Engine.load_checkpoint(tmp_path) as resumed:
        assert resumed.optimizer.state_dtype == "bf16"
        assert resumed.store.exp_avg.tensor.dtype == torch.bfloat16
        train(resumed, 3, 6)
        got = state(resumed)
    for name in expected:
        assert torch.equal(expected[name].view(torch.uint8), got[name].view(torch.uint8)), name


def test_bf16_state_refuses_bad_names_and_may_spill(tmp_path) -> None:
    with pytest.raises(ConfigError, match="state_dtype='fp16'"):
        optimizer("fp16")
    with pytest.raises(WorkloadError, match="must be fp32 or bf16"):
        Workload(16, 4, "fp32", optimizer_state="fp16")
    # m and v may go to spill files in bf16 too (tests/test_bf16_spill.py): the search may spill
    assert Workload(16, 4, "fp32", optimizer_state="bf16", spill_dir=str(tmp_path)).spill_choices() == ("none", "all")
    assert Workload(16, 4, "fp32", optimizer_state="bf16", spill="all", spill_dir=str(tmp_path)).spill == "all"


def test_planner_counts_8_bytes_of_state_per_parameter_by_hand() -> None:
    model = model_shapes.from_config(CONFIG.to_dict())
    N = model.numel_total
    rows = {}
    for state_dtype in ("fp32", "bf16"):
        est = memory_model.estimate(model, Workload(16, 4, "fp32", optimizer_state=state_dtype), PLAN)
        rows[state_dtype] = {c.name: c.nbytes for c in est.components if c.where == "host"}
    assert (rows["fp32"]["fp32 master"], rows["fp32"]["Adam m"], rows["fp32"]["Adam v"]) == (4 * N, 4 * N, 4 * N)
    assert (rows["bf16"]["fp32 master"], rows["bf16"]["Adam m"], rows["bf16"]["Adam v"]) == (4 * N, 2 * N, 2 * N)
    assert sum(rows["fp32"].values()) - sum(rows["bf16"].values()) == 4 * N
    # and the runtime allocates exactly that
    with engine("bf16") as e:
        s = e.store
        assert (s.master.nbytes, s.exp_avg.nbytes, s.exp_avg_sq.nbytes) == (4 * N, 2 * N, 2 * N)
