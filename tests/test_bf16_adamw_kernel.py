"""The bf16-state AdamW pass ([Note: bf16 optimizer state]): the compiled loop against the torch fallback bit for
bit, both against torch.optim.AdamW, unbiased rounding of the updated state, and the compiled path taken in training.

Every test here reuses the one build of the process (``native_adamw.load`` is cached; across processes the shared
library in the user's cache is loaded, not rebuilt)."""
from __future__ import annotations

import shutil

import pytest
import torch

from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan
from megatrain.runtime.optim import bf16_adamw, native_adamw
from megatrain.runtime.optim.adamw_kernel import AdamHyper
from megatrain.runtime.optim.stochastic_rounding import noise_base

HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def inputs(n: int, seed: int) -> list[torch.Tensor]:
    """fp32 master and gradient, bf16 m and v ([n] each) with the awkward values salted in: zeros, fp32 and bf16
    denormals, values near bf16's largest, negative zeros, tiny and huge gradients."""
    g = torch.Generator().manual_seed(seed)
    master, grads = torch.randn(n, generator=g), torch.randn(n, generator=g) * 3
    m, v = torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01
    specials = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 1e-45, 1e-38, BF16_MAX, -BF16_MAX, 3e38, 1e30, 1e-30])
    for t in (master, grads, m, v):
        pick = torch.randint(0, n, (min(n, 3 * len(specials)),), generator=g)
        t[pick] = specials.repeat(3)[:len(pick)]
    v.abs_()
    return [master, grads, m.bfloat16(), v.bfloat16()]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def compiled() -> None:
    """The compiled kernel, built once for the module; a machine with g++ must build it (no silent fallback)."""
    fn, why = bf16_adamw.kernel()
    if fn is None:
        assert shutil.which("g++") is None, f"g++ is here but the kernel did not build: {why}"
        pytest.skip(f"no compiled kernel here: {why}")


@pytest.mark.parametrize("n", [1, 15, 16, 17, 1000, native_adamw.GRAIN + 333])
@pytest.mark.parametrize("clip,decay,step", [(None, True, 1), (0.37, True, 1000), (None, False, 7), (0.5, False, 2)])
def test_compiled_loop_and_torch_fallback_write_the_same_bits(compiled, n, clip, decay, step) -> None:
    # odd sizes (not a multiple of any vector width), one thread or two (above the grain), every special value
    c = bf16_adamw.Constants.of(HYPER, step, decay, clip)
    base = noise_base(step, 3, 12_345)
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            fast, slow = inputs(n, n + step), inputs(n, n + step)
            bf16_adamw.update(*fast, base, c)
            bf16_adamw.torch_update(*slow, base, c)
        finally:
            torch.set_num_threads(before)
        assert same_bits(fast, slow), (n, clip, decay, step, threads)
        assert n < 16 or not same_bits(fast, inputs(n, n + step))  # it did update (not all special zeros)


def test_thread_count_does_not_change_the_bits(compiled) -> None:
    n = 4 * native_adamw.GRAIN + 77
    c = bf16_adamw.Constants.of(HYPER, 5, True, 0.8)
    out = []
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        t = inputs(n, 1)
        bf16_adamw.update(*t, 99, c)
        out.append(t)
    torch.set_num_threads(before)
    assert same_bits(*out)


@pytest.mark.parametrize("path", ["compiled", "torch"])
def test_the_update_is_adamw_with_state_rounded_to_a_bf16_neighbour(compiled, path) -> None:
    # against torch.optim.AdamW (fp32 state, clipping applied to the gradient first) from the same bf16-valued
    # state: the master within a few fp32 ULPs (another order of the same operations), m and v each one of the
    # two bf16 neighbours of fp32 AdamW's
    n, clip, step = 5000, 0.25, 3
    g = torch.Generator().manual_seed(4)
    master, grads = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m, v = (torch.randn(n, generator=g) * 0.1).bfloat16(), (torch.rand(n, generator=g) * 0.01).bfloat16()
    p = torch.nn.Parameter(master.clone())
    opt = torch.optim.AdamW([p], lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                            weight_decay=HYPER.weight_decay)
    p.grad = torch.zeros(n)
    opt.step()  # creates the state; then set it to the bf16 values at step - 1
    state = opt.state[p]
    state["step"].fill_(step - 1)
    state["exp_avg"].copy_(m.float())
    state["exp_avg_sq"].copy_(v.float())
    p.data.copy_(master)
    p.grad = grads * clip
    opt.step()
    ours = [master.clone(), grads.clone(), m.clone(), v.clone()]
    c = bf16_adamw.Constants.of(HYPER, step, True, clip)
    (bf16_adamw.update if path == "compiled" else bf16_adamw.torch_update)(*ours, 77, c)
    torch.testing.assert_close(ours[0], p.data, rtol=1e-6, atol=1e-7)
    assert torch.equal(ours[1], grads)  # the gradient is read, not scaled in place
    for got, exact in ((ours[2], state["exp_avg"]), (ours[3], state["exp_avg_sq"])):
        down = (exact.view(torch.int32) & -(1 << 16)).view(torch.float32)
        up = ((exact.view(torch.int32) & -(1 << 16)) + (1 << 16)).view(torch.float32)
        assert bool(((got.float() == down) | (got.float() == up)).all())


def test_the_updated_state_rounds_unbiased(compiled) -> None:
    # m = 1 and a zero gradient: m' = beta1 in fp32 (0.99900001), between the bf16 values 0.99609375 and 1; over
    # 200,000 elements the mean of the rounded m' is beta1's fp32 value within 5 standard errors
    n, beta1 = 200_000, 0.999
    hyper = AdamHyper(lr=1e-3, beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=0.0)
    t = [torch.zeros(n), torch.zeros(n), torch.ones(n).bfloat16(), torch.zeros(n).bfloat16()]
    bf16_adamw.update(*t, noise_base(1, 0, 0), bf16_adamw.Constants.of(hyper, 1, False, None))
    exact = float(torch.tensor(beta1))
    lo, hi = 0.99609375, 1.0
    assert set(t[2].float().unique().tolist()) == {lo, hi}
    share = (exact - lo) / (hi - lo)
    assert abs(float(t[2].double().mean()) - exact) < 5 * (hi - lo) * (share * (1 - share) / n) ** 0.5


def test_training_with_bf16_state_takes_the_compiled_path(compiled, monkeypatch) -> None:
    # the torch fallback made to fail: two steps of bf16 state train, so every update ran the compiled loop
    def refuse(*args: object) -> None:
        raise AssertionError("the torch fallback ran")

    monkeypatch.setattr(bf16_adamw, "torch_update", refuse)
    assert bf16_adamw.uses_compiled_kernel()
    config = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    optimizer = OptimizerConfig(lr=1e-2, max_grad_norm=1.0, state_dtype="bf16")
    with Engine(config, optimizer, plan=Plan(micro_batch_size=2), compute_dtype=torch.float32, device="cpu",
                seed=1) as e:
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            e.step(ids, ids)
        e.synchronize()
        assert int(e.store.steps[0]) == 2
