"""The experts over a routing sorted by expert (models/layers/sorted_experts.py): the grouped path
(torch._grouped_mm) and the per-expert loop each equal transformers' eager experts, forward and gradients, for
every sparse family's experts, with experts no token reaches; expert groups add up to the whole layer; the
grouped whole layer reads nothing to the host and the loop reads once per layer pass."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import GptOssConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.mixtral.modeling_mixtral import MixtralExperts
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from megatrain.models.gpt_oss import blocks as gpt_oss
from megatrain.models.layers import moe, sorted_experts
from megatrain.models.layers.sorted_experts import add_experts, sort_pairs

E, H, I, T, K = 6, 16, 8, 12, 2
ROUTED = (0, 1, 3, 4)  # experts 2 and 5 (the last) receive no token
FAMILIES = {
    "mixtral": lambda: MixtralExperts(MixtralConfig(num_local_experts=E, hidden_size=H, intermediate_size=I,
                                                    experts_implementation="eager")),
    "qwen3_moe": lambda: Qwen3MoeExperts(Qwen3MoeConfig(num_experts=E, hidden_size=H, moe_intermediate_size=I,
                                                        experts_implementation="eager")),
    "qwen2_moe": lambda: Qwen2MoeExperts(Qwen2MoeConfig(num_experts=E, hidden_size=H, moe_intermediate_size=I,
                                                        experts_implementation="eager")),
    "gpt_oss": lambda: GptOssExperts(GptOssConfig(num_local_experts=E, hidden_size=H, intermediate_size=I,
                                                  experts_implementation="eager")),
}


def _experts(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' eager experts with random weights, and megatrain's with the same."""
    torch.manual_seed(0)
    ref = FAMILIES[family]()
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.5)
    spec = SimpleNamespace(num_experts=E, hidden_size=H, moe_intermediate_size=I, hidden_act="silu")
    ours = (gpt_oss.Experts if family == "gpt_oss" else moe.Experts)(spec)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _routing() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], weights [T, K], experts [T, K] (distinct per token, only among ROUTED)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    routed = torch.tensor(ROUTED)
    experts = torch.stack([routed[torch.randperm(len(ROUTED), generator=g)[:K]] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, K, generator=g), -1)
    return x, weights, experts


def _run(module: torch.nn.Module, x, weights, experts, transformers: bool):
    """Output and gradients (x, weights, every parameter) for a fixed output gradient."""
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    out = module(x, experts, weights) if transformers else module(x, weights, experts)
    seed = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    params = [p for _, p in sorted(module.named_parameters())]
    return out, torch.autograd.grad(out, [x, weights, *params], seed)


@pytest.fixture
def counted(monkeypatch):
    """Counts of torch._grouped_mm calls and of host reads (Tensor.tolist) while the test runs."""
    counts = {"grouped_mm": 0, "tolist": 0}
    grouped_mm, tolist = torch._grouped_mm, torch.Tensor.tolist

    def counting_grouped_mm(*args, **kwargs):
        counts["grouped_mm"] += 1
        return grouped_mm(*args, **kwargs)

    def counting_tolist(self):
        counts["tolist"] += 1
        return tolist(self)

    monkeypatch.setattr(torch, "_grouped_mm", counting_grouped_mm)
    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    return counts


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_path_equals_transformers(family, grouped, monkeypatch, counted):
    monkeypatch.setattr(sorted_experts, "CPU_GROUPED", grouped)
    ref, ours = _experts(family)
    x, weights, experts = _routing()
    want_out, want = _run(ref, x, weights, experts, transformers=True)
    counted.update(grouped_mm=0, tolist=0)
    got_out, got = _run(ours, x, weights, experts, transformers=False)
    # the grouped layer: two grouped matmuls, no host read; the loop: one host read for the layer, not one per expert
    assert counted == ({"grouped_mm": 2, "tolist": 0} if grouped else {"grouped_mm": 0, "tolist": 1})
    torch.testing.assert_close(got_out, want_out)
    names = ["x", "weights", *sorted(n for n, _ in ours.named_parameters())]
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"{name}: {m}")
    for name, g in zip(names[2:], got[2:]):  # an expert no token reaches: zero gradient, biases included
        assert torch.count_nonzero(g[[2, 5]]) == 0 and torch.count_nonzero(g[list(ROUTED)]) > 0, name


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_grouped_equals_loop(family):
    """Both paths over the same experts and routing: outputs and gradients equal to float32 rounding."""
    _, ours = _experts(family)
    x, weights, experts = _routing()
    results = []
    for grouped in (True, False):
        x_, w_ = x.clone().requires_grad_(), weights.clone().requires_grad_()
        tensors = _tensors(ours, family)
        out = torch.zeros_like(x_)
        assert add_experts(out, x_, w_, sort_pairs(experts, E, read_starts=True), tensors, grouped=grouped)
        results.append((out, torch.autograd.grad(out.square().sum(), [x_, w_, *ours.parameters()])))
    (a, da), (b, db) = results
    torch.testing.assert_close(a, b)
    for g, l in zip(da, db):
        torch.testing.assert_close(g, l)


def _tensors(ours: torch.nn.Module, family: str) -> sorted_experts.ExpertTensors:
    return ours.tensors(dict(ours.named_parameters()))


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
@pytest.mark.parametrize("size", [1, 4])
def test_groups_add_up_to_the_layer(size, grouped):
    """Experts in groups of ``size`` (as expert groups stream them, the starts read once) add up to the whole
    layer, and a group whose experts got no token says so."""
    _, ours = _experts("gpt_oss")
    x, weights, experts = _routing()
    whole = torch.zeros_like(x)
    add_experts(whole, x, weights, sort_pairs(experts, E, read_starts=False), _tensors(ours, "gpt_oss"))
    pairs = sort_pairs(experts, E, read_starts=True)
    out, ran = torch.zeros_like(x), []
    for first in range(0, E, size):
        t = _tensors(ours, "gpt_oss")
        group = sorted_experts.ExpertTensors(*(v[first:first + size] for v in (t.gate_up, t.down)), t.glu,
                                             *(v[first:first + size] for v in (t.gate_up_bias, t.down_bias)))
        ran.append(add_experts(out, x, weights, pairs, group, first, grouped=grouped))
    torch.testing.assert_close(out, whole)
    assert ran == [any(e in ROUTED for e in range(f, f + size)) for f in range(0, E, size)]


def test_sort_pairs_is_torch_where_order():
    _, _, experts = _routing()
    pairs = sort_pairs(experts, E, read_starts=True)
    counts = torch.bincount(experts.reshape(-1), minlength=E)
    assert pairs.ends.dtype == torch.int32 and pairs.ends.tolist() == torch.cumsum(counts, 0).tolist()
    for e in range(E):
        token, slot = torch.where(experts == e)
        assert pairs.order[pairs.starts[e]:pairs.starts[e + 1]].tolist() == (token * K + slot).tolist()


def test_rule():
    x = torch.zeros(4, H)
    t = moe.Experts(SimpleNamespace(num_experts=E, hidden_size=H, moe_intermediate_size=I, hidden_act="silu"))
    tensors = t.tensors(dict(t.named_parameters()))
    assert sorted_experts.grouped_mm_runs(x, tensors) == sorted_experts.CPU_GROUPED
    assert not sorted_experts.grouped_mm_runs(x.bfloat16(), tensors._replace(
        gate_up=tensors.gate_up.bfloat16(), down=tensors.down.bfloat16()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_bf16_cuda():
    """CUDA bf16: the rule picks the grouped kernel on compute capability 9.x/10.x, and it equals the loop (bf16
    rounding), experts with no token included."""
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("torch's grouped bf16 kernel needs compute capability 9.x or 10.x")
    torch.manual_seed(0)
    e, h, i, t, k = 8, 256, 128, 512, 2
    ours = moe.Experts(SimpleNamespace(num_experts=e, hidden_size=h, moe_intermediate_size=i,
                                       hidden_act="silu")).cuda().bfloat16()
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    experts = torch.stack([torch.randperm(e - 2, device="cuda")[:k] for _ in range(t)])  # the last two: no token
    weights = torch.softmax(torch.randn(t, k, device="cuda"), -1).bfloat16()
    tensors = ours.tensors(dict(ours.named_parameters()))
    assert sorted_experts.grouped_mm_runs(x, tensors)
    results = []
    for grouped in (True, False):
        x_ = x.clone().requires_grad_()
        out = torch.zeros_like(x_)
        add_experts(out, x_, weights, sort_pairs(experts, e, read_starts=not grouped), tensors, grouped=grouped)
        results.append((out, torch.autograd.grad(out.float().square().sum(), [x_, *ours.parameters()])))
    (a, da), (b, db) = results
    torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    for g, l in zip(da, db):
        torch.testing.assert_close(g, l, rtol=2e-2, atol=2e-2)
    assert all(torch.count_nonzero(g[-2:]) == 0 for g in da[1:])  # the experts no token reached
