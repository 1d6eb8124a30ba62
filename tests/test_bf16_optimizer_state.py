"""bf16 AdamW state ([Note: bf16 optimizer state]): stochastic rounding, training, exact resume, the planner's bytes."""
from __future__ import annotations

import pytest
import torch

from megatrain.planner.costs import memory_model
from megatrain.planner.shapes import model_shapes
from megatrain.planner.shapes.workload import Workload, WorkloadError
from megatrain.runtime import ConfigError, Engine, ModelConfig, OptimizerConfig, Plan
from megatrain.runtime.optim import bf16_adamw
from megatrain.runtime.optim.adamw_kernel import AdamHyper
from megatrain.runtime.optim.stochastic_rounding import MIX, mix, noise, noise_base, noise_key, round_stochastic

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


def rounded(src: torch.Tensor, base: int, half: int = 0) -> torch.Tensor:
    """src (fp32 [n]) rounded to bf16 with the noise from mix input ``base`` on (m's half: 0, v's: 1)."""
    bits = noise(base, src.numel())
    return round_stochastic(src.clone(), (bits >> 16) if half else (bits & 0xFFFF))


def unmix(x: torch.Tensor) -> torch.Tensor:
    """mix's inverse, step by step (x ^= x >> s undone by xor-ing the shifts back in; x *= c by c's inverse
    modulo 2^32): it exists, so mix is a bijection of the 32-bit integers."""
    mask = 0xFFFFFFFF

    def unshift(y: torch.Tensor, s: int) -> torch.Tensor:
        out = y.clone()
        for _ in range(32 // s + 1):
            out = y ^ (out >> s)
        return out

    def unmul(y: torch.Tensor, c: int) -> torch.Tensor:
        inv = pow(c, -1, 1 << 32)  # split in 16-bit halves so every product fits in an int64
        return ((y * (inv & 0xFFFF)) + (((y * (inv >> 16)) & 0xFFFF) << 16)) & mask

    x = unshift(x, 16)
    x = unmul(x, MIX[1])
    x = unshift(x, 15)
    x = unmul(x, MIX[0])
    return unshift(x, 16)


def test_mix_is_a_bijection_so_the_noise_is_exactly_uniform_over_the_key() -> None:
    # mix undone exactly on random and edge values: a bijection, so over a uniformly random key each element's
    # 32 noise bits are uniform, m's 16 and v's 16 exactly uniform and independent
    x = torch.cat([torch.randint(0, 1 << 32, (100_000,), dtype=torch.int64, generator=torch.Generator().manual_seed(3)),
                   torch.tensor([0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF])])
    assert torch.equal(unmix(mix(x.clone())), x)
    assert int(mix(x.clone()).min()) >= 0 and int(mix(x.clone()).max()) <= 0xFFFFFFFF
    # no visible pattern along a block: neighbours uncorrelated, low bits fair coins, m's and v's halves apart
    bits = noise(noise_base(5, 2, 0), 1 << 16)
    for half in (bits & 0xFFFF, bits >> 16):
        h = half.double()
        assert abs(float(torch.corrcoef(torch.stack([h[:-1], h[1:]]))[0, 1])) < 0.02
        assert abs(float((half & 1).double().mean()) - 0.5) < 0.01
        assert abs(float(h.mean()) / (1 << 16) - 0.5) < 0.01
    assert abs(float(torch.corrcoef(torch.stack([(bits & 0xFFFF).double(), (bits >> 16).double()]))[0, 1])) < 0.02


def test_stochastic_rounding_is_unbiased_where_nearest_is_not() -> None:
    # 1 + 2^-9 lies a quarter of a bf16 ULP (2^-7) above 1: round-to-nearest always gives 1.0 (bias -2^-9);
    # stochastic rounding gives 1 + 2^-7 a quarter of the time, 1.0 otherwise: the mean is the value itself.
    value = 1.0 + 2.0 ** -9
    draws = 200_000
    dst = rounded(torch.full((draws,), value), noise_base(3, 1, 0))
    assert set(dst.float().unique().tolist()) == {1.0, 1.0 + 2.0 ** -7}
    nearest = float(torch.tensor(value).bfloat16().double())
    assert nearest == 1.0 and abs(nearest - value) == 2.0 ** -9
    # the share rounded up is within 5 standard errors (2^-7 x sqrt(0.25 x 0.75 / 200000) = 7.6e-6) of a quarter
    assert abs(float(dst.double().mean()) - value) < 4e-5
    # negative values round the same way in magnitude, v's half of the noise too
    for half in (0, 1):
        got = rounded(torch.full((draws,), -value), noise_base(4, 1, 0), half)
        assert abs(float(got.double().mean()) + value) < 4e-5


def test_rounding_one_element_over_many_keys_is_unbiased() -> None:
    # the same element (block 2, element 70000) across 4000 AdamW steps: its noise comes from 4000 hashed
    # keys; the mean of its roundings converges to the value (standard error 2^-7 x sqrt(0.3 x 0.7 / 4000))
    value = 1.0 + 0.3 * 2.0 ** -7
    for half in (0, 1):
        ups = [float(rounded(torch.full((1,), value), noise_base(step, 2, 70_000), half)[0]) > 1.0
               for step in range(4000)]
        share = sum(ups) / len(ups)
        assert abs(share - 0.3) < 5 * (0.3 * 0.7 / 4000) ** 0.5


def test_stochastic_rounding_is_deterministic_for_the_same_key() -> None:
    src = torch.randn(10_000)
    a = rounded(src, noise_base(7, 3, 1024))
    b = rounded(src, noise_base(7, 3, 1024))
    c = rounded(src, noise_base(8, 3, 1024))
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert not torch.equal(a.view(torch.int16), c.view(torch.int16))
    # every result is one of the two bf16 neighbours of its source (truncated, or that plus one ULP)
    down = (src.view(torch.int32) & -(1 << 16)).view(torch.float32)
    up = ((src.view(torch.int32) & -(1 << 16)) + (1 << 16)).view(torch.float32)
    assert bool(((a.float() == down) | (a.float() == up)).all())
    keys = {noise_key(s, b) for s in range(30) for b in range(30)}
    assert len(keys) == 900  # distinct keys hash apart (2^32 keys: a collision here would be 1 in ~10^4)


def test_a_block_updated_in_chunks_gets_the_bits_of_one_pass() -> None:
    # a block's range updated whole, or in pieces at offsets (spill chunks), gets the same bits: each element's
    # noise is its own index's, whatever the run that holds it
    layout = engine_layout()
    n = layout.numel
    g = torch.Generator().manual_seed(9)
    flats = [torch.randn(n, generator=g), torch.randn(n, generator=g), torch.randn(n, generator=g).bfloat16(),
             torch.rand(n, generator=g).bfloat16()]
    hyper = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    whole = [t.clone() for t in flats]
    bf16_adamw.update_entries(hyper, layout, 0, whole, 3, 1, 0.5)
    parts = [t.clone() for t in flats]
    for lo, hi in ((0, 1000), (1000, 1001), (1001, n)):
        bf16_adamw.update_entries(hyper, layout, lo, [t[lo:hi] for t in parts], 3, 1, 0.5)
    assert all(torch.equal(w.view(torch.uint8), p.view(torch.uint8)) for w, p in zip(whole, parts))
    assert not torch.equal(whole[0], flats[0])


def engine_layout():
    """A decoder layer's layout of the tiny model (entries with and without weight decay)."""
    with engine("bf16") as e:
        return e.templates.blocks[1].layout


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
