"""The planner's memory model against what the runtime allocates for mixture-of-experts layers, buffer by buffer:
what a kept sparse layer's graph holds, what a recomputed one's backward saves whole or in expert groups, what a
layer in groups holds between its loads, and the step's routing statistics (planner/costs/moe_memory.py,
planner/costs/sparse_working_set.py), for Qwen3-MoE, Mixtral, Qwen2-MoE (its shared expert) and gpt-oss (its sinks and
biases). As ``test_plan_runtime_agreement.py`` does for dense layers; the planner never imports the runtime, so
nothing but this test keeps the two in step.
"""
from __future__ import annotations

import weakref

import pytest
import torch

from megatrain.planner.costs import memory_model, moe_memory, sparse_working_set
from megatrain.planner.shapes import model_shapes
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload
from megatrain.runtime import Engine, ModelConfig, OptimizerConfig
from megatrain.runtime.pipeline.experts import expert_layers

_BASE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    "qwen3_moe": dict(_BASE, model_type="qwen3_moe", intermediate_size=64, head_dim=8, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True),
    "mixtral": dict(_BASE, model_type="mixtral", intermediate_size=24, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(_BASE, model_type="qwen2_moe", intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=24, shared_expert_intermediate_size=40),
    "gpt_oss": dict(_BASE, model_type="gpt_oss", intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                    head_dim=8),
}
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.01)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _engine(hf: dict, plan: Plan, dtype: str) -> Engine:
    return Engine(ModelConfig.from_hf(hf), OptimizerConfig(max_grad_norm=1.0), plan=plan, compute_dtype=DTYPES[dtype],
                  device="cpu", seed=0)


def _ids(hf: dict, rows: int, seq: int) -> torch.Tensor:
    return torch.randint(0, hf["vocab_size"], (rows, seq), generator=torch.Generator().manual_seed(0))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storages(tensors) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    return sum(seen.values())


@pytest.mark.parametrize("aux", [False, True], ids=["", "aux"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_kept_sparse_layers_hold_what_the_planner_counts(name: str, dtype: str, aux: bool) -> None:
    """A kept sparse layer's graph holds the planner's kept activations to the byte (router, routed pairs, the
    grouped path's ends, the shared expert, gpt-oss's sink rows; with the load-balancing loss its logits too), over
    micro-batches of 2 and 1 sequences; and the engine's slots, gradient buffers and routing counts are the
    planner's terms."""
    if aux and (dtype, name) not in (("fp32", "qwen3_moe"), ("bf16", "gpt_oss"), ("fp32", "mixtral")):
        pytest.skip("the loss's logits: three families and dtypes suffice")
    hf = dict(CONFIGS[name], **(AUX if aux else {}))
    shape = model_shapes.from_config(hf)
    batch, seq = 3, 8
    plan = Plan(micro_batch_size=2, kept_layers=(0,))
    work = Workload(seq_len=seq, batch=batch, compute_dtype=dtype)
    est = {c.name: c.nbytes for c in memory_model.estimate(shape, work, plan).components}
    with _engine(hf, plan, dtype) as engine:
        ex = engine.executor
        assert shape.params == engine.num_parameters and shape.numel_total == engine.store.total_numel
        assert est["weight slots"] == sum(_nbytes(b) for b in ex.slots.buffers)
        assert est["grad accumulators"] == sum(_nbytes(b) for b in ex.grad_buffers.buffers)
        engine.step(_ids(hf, batch, seq), _ids(hf, batch, seq))
        assert est["kept activations"] == ex.kept.held_bytes > 0
        routing = ex.routing.last
        held = [routing.tokens] + [t for t in (routing.assigned, routing.prob_sum, routing.weights) if t is not None]
        assert est["routing statistics"] == _storages(held)


class _SavedBytes:
    """The distinct storages autograd's graphs save (each released with the last graph holding it) and their peak,
    the weights' slots and the step's RoPE tables aside (neither is a layer's working set)."""

    def __init__(self) -> None:
        self.held = self.peak = 0
        self.aside: set[int] = set()
        self._refs: dict[int, list[int]] = {}

    def pack(self, t: torch.Tensor) -> tuple[object, torch.Tensor]:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.aside:
            return None, t
        if ptr not in self._refs:
            self._refs[ptr] = [0, storage.nbytes()]
            self.held += storage.nbytes()
            self.peak = max(self.peak, self.held)
        self._refs[ptr][0] += 1
        token = _Token()  # held by the graph with the tensor: its finalizer runs when the graph lets both go
        weakref.finalize(token, self._release, ptr)
        return token, t

    def _release(self, ptr: int) -> None:
        self._refs[ptr][0] -= 1
        if not self._refs[ptr][0]:
            self.held -= self._refs.pop(ptr)[1]


class _Token:
    """A saved tensor's handle."""


class _RoutedBytes:
    """What ``ExpertLayers`` holds for a layer between its loads: after its forward's dense load and after its
    backward's first (dense) load, every tensor of that state, the checkpoints it only references aside."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, checkpoints_on_device: bool) -> None:
        self.forward: list[int] = []
        self.backward: list[int] = []
        forward, backward = expert_layers.ExpertLayers.forward, expert_layers.ExpertLayers.backward

        def on_forward(layers, load, params, x, micro, positions, training):
            forward(layers, load, params, x, micro, positions, training)
            if load.part.number == 0:
                routed, sums = layers._forward[load.layer]
                self.forward.append(_storages([*sums, *(t for r in routed for t in _tensors(r))]))

        def on_backward(layers, step, load, params, micro, positions, dy, hyper):
            first = load.layer not in layers._backward
            out = backward(layers, step, load, params, micro, positions, dy, hyper)
            if first:
                s = layers._backward[load.layer]
                inputs = [] if checkpoints_on_device else s.inputs
                self.backward.append(_storages([*inputs, *s.tokens, *(t for r in s.routing for t in _tensors(r)),
                                                *s.d_tokens, *s.d_weights, s.squares]))
            return out

        monkeypatch.setattr(expert_layers.ExpertLayers, "forward", on_forward)
        monkeypatch.setattr(expert_layers.ExpertLayers, "backward", on_backward)


def _tensors(x) -> list[torch.Tensor]:
    """The tensors of a nested tuple (a routed micro-batch, a routing)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, tuple):
        return [t for item in x for t in _tensors(item)]
    return []


# (expert group size, checkpoints): whole layers; one group of every expert (its pairs are all of them); groups of
# one expert (a bound: no expert gets every token) with host checkpoints, whose inputs the backward copies.
GROUPINGS = [(None, "device"), (4, "device"), (1, "host")]


@pytest.mark.parametrize("grouping", GROUPINGS, ids=["whole", "one-group", "groups-of-1-host"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_recomputed_sparse_layers_save_what_the_planner_counts(name: str, dtype: str, grouping: tuple,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer recomputed: the most a layer's backward graphs save at once is the planner's
    ``layer_saved_bytes`` (whole, and in one group of every expert, to the byte; in groups of one expert, between the
    dense part's bytes and the bound); a layer in groups holds between its loads the planner's ``routed_passes``,
    forward and backward; the engine's slots and gradient buffers are the planner's, one part's in groups."""
    if dtype == "bf16" and name in ("qwen2_moe", "qwen3_moe") and grouping[0] is not None:
        pytest.skip("the loop path in groups: Mixtral and gpt-oss suffice")
    group, checkpoints = grouping
    hf = CONFIGS[name]
    shape = model_shapes.from_config(hf)
    rows, seq = 2, 16
    plan = Plan(micro_batch_size=1, loss_chunk_tokens=4, expert_group_size=group, checkpoints=checkpoints,
                kept_layers=())
    work = Workload(seq_len=seq, batch=rows, compute_dtype=dtype)
    est = {c.name: c.nbytes for c in memory_model.estimate(shape, work, plan).components}
    planned, _ = sparse_working_set.layer_saved_bytes(shape, work, plan)
    saved, routed = _SavedBytes(), _RoutedBytes(monkeypatch, checkpoints == "device")
    with _engine(hf, plan, dtype) as engine:
        ex = engine.executor
        assert est["weight slots"] == sum(_nbytes(b) for b in ex.slots.buffers)
        assert est["grad accumulators"] == sum(_nbytes(b) for b in ex.grad_buffers.buffers)
        tables = [t for kind in ex.rotary.ropes for t in ex.rotary.table(seq, kind)]  # the step's, made now
        saved.aside = {t.untyped_storage().data_ptr() for t in (*ex.slots.buffers, *tables)}
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda packed: packed[1]):
            engine.step(_ids(hf, rows, seq), _ids(hf, rows, seq))
    if group == 1:  # at least the dense part's: the whole layer's less its pairs and ends
        whole, _ = sparse_working_set.layer_saved_bytes(shape, work, plan.replace(expert_group_size=None))
        k, p = shape.experts.num_experts_per_tok, moe_memory.pair_bytes(shape, dtype)
        assert whole - seq * k * p - moe_memory.micro_batch_bytes(shape, dtype) <= saved.peak <= planned
    else:
        assert saved.peak == planned
    if group is None:
        assert not routed.forward and "expert-group routed state" not in est
        return
    forward, backward = sparse_working_set.routed_passes(shape, work, plan)
    assert routed.forward == [forward] * shape.num_layers and routed.backward == [backward] * shape.num_layers
    assert est["expert-group routed state"] == max(forward, backward)
