"""``Plan.compiled_layers`` ([Note: compiled layers] in runtime/model/compiled_layers.py): the decoder layers'
forward through ``torch.compile`` trains as the eager plan does, within float rounding (compiled code computes
the same operations in another order, so not bitwise: tests/numerics.py's bound), every layer call of the step
(forward, kept layers, recompute) going through the one compiled function; attention stays the same SDPA
operator; packed documents run eagerly; the plans and models it cannot compile are refused in one line; a plan
file without the field reads as eager.

The fast tests compile with ``aot_eager`` (AOTAutograd's forward and backward graphs run by eager kernels, no
code generated; ``MEGATRAIN_COMPILE_BACKEND``): the runtime's wiring, the autograd through compiled graphs and the
recompiles for a short last micro-batch are the same as with inductor, which the ``slow`` test runs (it needs a
C++ compiler: g++ here).
"""
from __future__ import annotations

import json

import pytest
import torch

from megatrain.plan.plan import Plan, PlanError
from megatrain.runtime import Engine, ModelConfig, OptimizerConfig
from megatrain.runtime.model.compiled_layers import BACKEND_VARIABLE
from megatrain.tools import compiled_layer_probe
from numerics import assert_update_close

LLAMA = dict(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "llama": LLAMA,
    "qwen3": dict(LLAMA, model_type="qwen3", head_dim=12, tie_word_embeddings=True),  # q/k norms, tied head
    # sliding (window 5) and global layers: two layer types, two templates through the one compiled function
    "gemma3": dict(LLAMA, model_type="gemma3_text", head_dim=12, sliding_window=5, sliding_window_pattern=2,
                   final_logit_softcapping=3.0, pad_token_id=None, bos_token_id=None, eos_token_id=None),
}
# Layer 1 kept, layer 0 recomputed; 5 rows in micro-batches of 2, 2, 1 (the short last one compiles its own graphs)
PLAN = Plan(micro_batch_size=2, kept_layers=(1,), checkpoints="host", num_slots=3, prefetch_depth=2)
SEQ = 12


def _train(config: ModelConfig, plan: Plan, steps: int = 2, rows: int = 5) -> tuple[
        list[float], dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """Losses, the weights before and after ``steps`` steps of ``rows`` rows, and how many layer calls went through
    the compiled function."""
    gen = torch.Generator().manual_seed(5)
    with Engine(config, OptimizerConfig(lr=1e-2, max_grad_norm=1.0), plan=plan, compute_dtype=torch.float32,
                device="cpu", seed=3) as engine:
        initial = engine.state_dict()
        losses = []
        for _ in range(steps):
            ids = torch.randint(0, config.vocab_size, (rows, SEQ), generator=gen)
            losses.append(engine.step(ids, ids).item())
        return losses, initial, engine.state_dict(), engine.executor.run_layer.compiled_calls


# A CPU device's own choices: computing on the host's weights (every layer's views at another offset of one arena)
IN_PLACE = PLAN.replace(compute_in_place=True, adam_thread="compute")


def _assert_trains_as_eager(family: str, rows: int, plan: Plan) -> None:
    """Two clipped steps over micro-batches of 2 rows (with 5 rows, a short last one), a kept and a recomputed
    layer: the losses within 1e-5 of the eager plan's, every weight within 1e-3 of the mean update (numerics.py:
    99.9% of elements, none beyond 5%). Every layer call of the step ran compiled: per step each layer's forward
    for each micro-batch, and the recomputed layer's once more each in backward; no graph break; one graph per
    layer type, grad mode and micro-batch shape: without grad the recomputed layers' forwards, with it the kept
    layer's forward and the recompute."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    config = ModelConfig.from_hf(FAMILIES[family])
    losses, initial, weights, calls = _train(config, plan, rows=rows)
    got_losses, got_initial, got, compiled_calls = _train(config, plan.replace(compiled_layers=True), rows=rows)
    assert calls == 0 and all(torch.equal(got_initial[k], v) for k, v in initial.items())
    assert got_losses == pytest.approx(losses, rel=1e-5)
    assert_update_close(got, weights, initial)
    micro, layers = -(-rows // 2), config.num_hidden_layers
    assert compiled_calls == 2 * micro * (layers + layers - len(plan.kept_layers))
    assert not torch._dynamo.utils.counters["graph_break"]
    types = [config.layer_types[i] if config.layer_types else None for i in range(layers)]
    no_grad = {t for i, t in enumerate(types) if i not in plan.kept_layers}
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == (1 + rows % 2) * (len(no_grad) + len(set(types)))


@pytest.mark.parametrize("family", ["llama", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_compiled_layers_train_as_eager(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_assert_trains_as_eager`` with the weights copied into slots, over 5 rows (2 + 2 + 1); Gemma 3: its
    sliding and global layers, two templates through the one compiled function."""
    monkeypatch.setenv(BACKEND_VARIABLE, "aot_eager")
    _assert_trains_as_eager(family, 5, PLAN)


def test_a_checkpoint_resumes_compiled(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint records the plan with its field, and the resumed engine's step is the bits the first engine's
    next step computes (both compiled)."""
    monkeypatch.setenv(BACKEND_VARIABLE, "aot_eager")
    config = ModelConfig.from_hf(LLAMA)
    ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with Engine(config, plan=Plan(compiled_layers=True), compute_dtype=torch.float32, device="cpu") as first:
        first.step(ids, ids)
        first.save_checkpoint(tmp_path, blocking=True)
        expected = first.step(ids, ids).item()
    with Engine.load_checkpoint(tmp_path, device="cpu") as resumed:
        assert resumed.plan.compiled_layers and resumed.executor.run_layer.compiled
        assert resumed.step(ids, ids).item() == expected and resumed.executor.run_layer.compiled_calls > 0


def test_packed_documents_run_the_layers_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step over packed rows (position ids restarting per document) calls no compiled layer (a graph would hold
    that micro-batch's packing): the same bits as the eager plan's step."""
    monkeypatch.setenv(BACKEND_VARIABLE, "aot_eager")
    config = ModelConfig.from_hf(LLAMA)
    ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(5), torch.arange(SEQ - 5)]).repeat(2, 1)
    out = []
    for compiled in (False, True):
        with Engine(config, plan=Plan(compiled_layers=compiled), compute_dtype=torch.float32, device="cpu",
                    seed=3) as engine:
            loss = engine.step(ids, ids, position_ids=positions).item()
            out.append((loss, engine.state_dict(), engine.executor.run_layer.compiled_calls))
    (eager, eager_weights, _), (loss, weights, calls) = out
    assert calls == 0 and loss == eager
    assert all(torch.equal(weights[k], v) for k, v in eager_weights.items())


def test_compiling_keeps_attention_to_the_same_operator() -> None:
    """The profile's probe on a tiny layer (aot_eager): the compiled layer's forward and backward ran the SDPA
    operators the eager one did (the CPU's flash kernel), and its figures are what the planner reads."""
    got = compiled_layer_probe.measure("tiny", "cpu", "float32", backend="aot_eager", pairs=1)
    assert got["same_attention"], got["attention_ops"]
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in got["attention_ops"]["compiled"]
    assert got["compiled_calls"] > 0 and got["speedup"] > 0 and got["backend"] == "aot_eager"


@pytest.mark.slow
def test_inductor_trains_as_eager_and_keeps_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """With inductor (C++ kernels generated and built here): the Llama case of the fast test within the same
    bounds, and the probe's compiled layer on the same SDPA operators as eager."""
    monkeypatch.setenv(BACKEND_VARIABLE, "inductor")
    torch._dynamo.reset()
    config = ModelConfig.from_hf(LLAMA)
    losses, initial, weights, _ = _train(config, PLAN)
    got_losses, _, got, calls = _train(config, PLAN.replace(compiled_layers=True))
    assert calls > 0 and got_losses == pytest.approx(losses, rel=1e-5)
    assert_update_close(got, weights, initial)
    probe = compiled_layer_probe.measure("tiny", "cpu", "float32", backend="inductor", pairs=1)
    assert probe["same_attention"], probe["attention_ops"]


def test_compiled_layers_computing_in_place_train_as_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_assert_trains_as_eager`` for Qwen 3 (q/k norms, a tied head) computing on the host's weights in place (each
    layer's views at another offset of one arena: still one graph per grad mode), over 4 rows (2 + 2)."""
    monkeypatch.setenv(BACKEND_VARIABLE, "aot_eager")
    _assert_trains_as_eager("qwen3", 4, IN_PLACE)


def test_what_cannot_compile_is_refused_in_one_line() -> None:
    """Sequence tiles and expert groups call a layer in parts; a sparse model's routing changes its shapes."""
    for tiles in (dict(mlp_tile_tokens=4), dict(attention_tile_tokens=4), dict(expert_group_size=2)):
        with pytest.raises(PlanError, match="compiled_layers compiles whole layers"):
            Plan(compiled_layers=True, **tiles)
    with pytest.raises(PlanError, match="must be true or false"):
        Plan(compiled_layers=1)
    moe = ModelConfig.from_hf(dict(LLAMA, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=16, head_dim=12))
    with pytest.raises(PlanError, match="sparse"):
        Engine(moe, plan=Plan(compiled_layers=True), compute_dtype=torch.float32, device="cpu")


def test_a_plan_file_without_the_field_reads_as_eager() -> None:
    """Written only when set, so an eager plan's file is what it was before the field; read back either way."""
    eager = Plan(micro_batch_size=2)
    assert "compiled_layers" not in eager.to_dict()
    assert Plan.from_json(eager.to_json()) == eager and not Plan.from_json(eager.to_json()).compiled_layers
    compiled = eager.replace(compiled_layers=True)
    assert json.loads(compiled.to_json())["compiled_layers"] is True
    assert Plan.from_json(compiled.to_json()) == compiled
