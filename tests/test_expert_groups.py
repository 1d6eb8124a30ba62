"""Expert groups ([Note: expert groups] in runtime/pipeline/experts/expert_parts.py): a sparse layer streamed as its
dense part and groups of experts trains as the whole layer does, and as transformers does; the planner sizes slots by
the largest part and chooses the group size by the device budget; the schedule holds at most K parts resident.

Equality with the whole layer in float32 on this CPU: the forward is bitwise (the whole layer's operations in its
order), so the first step's loss is equal to the bit everywhere. The experts' gradients are the same autograd
operations on the same inputs; the gradient of the routed tokens is summed over groups where autograd sums it
over experts, then the router's and the shared expert's terms are added: with at most two experts a token and
no shared expert that is the association autograd takes (bitwise, asserted), with more terms it may differ by
float32 rounding (``assert_update_close``), as it does with sequence tiles (the whole layer's backward is then
``sequence_tiles.py``'s, another summation order).
"""
from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings, strategies as st

from megatrain.planner.costs import memory_model
from megatrain.planner.shapes import model_shapes
from megatrain.planner.choice import candidate_fit
from megatrain.planner.profiling.hardware import preset
from megatrain.planner.costs.memory_model import CUDA_CONTEXT_BYTES
from megatrain.planner.shapes.workload import Workload
from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan
from megatrain.runtime.errors import ConfigError
from hypothesis_budget import examples
from numerics import assert_update_close

transformers = pytest.importorskip("transformers")

from hf_reference import assert_matches_transformers, randomize_norms_and_biases  # noqa: E402
from test_families import TINY  # noqa: E402


def _config(model_type: str = "qwen3_moe", experts: int = 6, top_k: int = 2, **extra) -> dict:
    shared = {"shared_expert_intermediate_size": 24} if model_type == "qwen2_moe" else {}
    return {"model_type": model_type, **TINY, "num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": 16, "norm_topk_prob": True, **shared, **extra}


LR, STEPS = 1e-3, 3


def _train(config: dict, plan: Plan, steps: int = STEPS, clip: float | None = 1.0, rows: int = 4, seq: int = 12,
           log: bool = False) -> tuple:
    """Losses, weights after and before ``steps`` fp32 AdamW steps of a seeded model on seeded batches, the engine,
    its event log, and per parameter the elements whose gradient was at the float32 noise floor in some step (their
    AdamW second moment tiny: there two honest trainings may flip the update's sign, numerics.py)."""
    optimizer = OptimizerConfig(lr=LR, weight_decay=0.1, max_grad_norm=clip)
    engine = Engine(ModelConfig.from_hf(config), optimizer, plan=plan, compute_dtype=torch.float32, device="cpu",
                    seed=3)
    engine.event_log.enabled = log
    try:
        initial = engine.state_dict()
        gen = torch.Generator().manual_seed(11)
        losses, floor = [], {}
        for step in range(steps):
            ids = torch.randint(0, config["vocab_size"], (rows, seq), generator=gen)
            losses.append(engine.step(ids, ids).item())
            state = engine.optimizer_state_dict()
            rms = {n: (s["exp_avg_sq"].double() / (1 - optimizer.betas[1] ** (step + 1))).sqrt()
                   for n, s in state.items()}
            largest = max(r.max().item() for r in rms.values())
            for n, r in rms.items():
                at = r <= max(10 * optimizer.eps, 0.01 * r.mean().item(), 1e-5 * largest)
                floor[n] = at | floor.get(n, at)
        engine.synchronize()
        return losses, engine.state_dict(), initial, engine, list(engine.event_log.entries), floor
    finally:
        engine.close()


def _assert_same(whole: tuple, grouped: tuple, bitwise: bool) -> None:
    assert grouped[0][0] == whole[0][0], "the first step's forward is the whole layer's, bit for bit"
    if bitwise:
        assert grouped[0] == whole[0]
        for name, w in whole[1].items():
            assert torch.equal(grouped[1][name], w), name
    else:
        for a, b in zip(grouped[0], whole[0]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(b))
        floor = {n: whole[5][n] | grouped[5][n] for n in whole[5]}
        # a noise-floor element can at worst flip its update's sign each step (|update| <= ~lr)
        assert_update_close(grouped[1], whole[1], whole[2], noise_floor=floor, floor_bound=3.0 * STEPS * LR + 1e-7)


def _budget_between(shape, work: Workload, plan: Plan) -> int:
    """A GPU memory budget a whole-layer plan overruns and the plan in groups of one expert fits."""
    hw = preset("H100-SXM", "server-512g")
    whole = memory_model.estimate(shape, work, plan, hw).device_bytes
    grouped = memory_model.estimate(shape, work, plan.replace(expert_group_size=1), hw).device_bytes
    assert grouped < whole
    return (whole + grouped) // 2


def test_a_layer_larger_than_the_device_budget_trains_in_groups_like_the_whole_layer_and_transformers() -> None:
    config = _config(experts=16, moe_intermediate_size=64)
    shape = model_shapes.from_config(config, "tiny-qwen3-moe")
    work = Workload(seq_len=20, batch=3, compute_dtype="float32", spill="none")
    base = Plan(micro_batch_size=1, loss_chunk_tokens=16)
    hw = preset("H100-SXM", "server-512g").replace(gpu_mem_bytes=_budget_between(shape, work, base))
    # the budget beyond the CUDA context holds less than one whole layer's weights, slots and gradient buffers
    assert shape.numel_layer * 4 * (base.num_slots + base.device_grad_buffers) > hw.gpu_mem_bytes - CUDA_CONTEXT_BYTES
    plan = candidate_fit.expert_groups(shape, work, base, hw)
    assert plan.expert_group_size in shape.experts.group_sizes()[1:]
    bu, _ = memory_model.slot_numel(shape, plan)
    assert bu < shape.numel_layer
    assert memory_model.estimate(shape, work, plan, hw).device_bytes <= hw.gpu_mem_bytes

    whole, grouped = _train(config, base), _train(config, plan)
    _assert_same(whole, grouped, bitwise=True)
    slot = grouped[3].executor.slots.buffers[0].numel()
    assert slot == bu and slot < shape.numel_layer  # the runtime's slot is the planner's Bu

    torch.manual_seed(5)
    hf_config = transformers.AutoConfig.for_model("qwen3_moe", **{k: v for k, v in config.items() if k != "model_type"})
    hf = transformers.Qwen3MoeForCausalLM(hf_config).float()
    randomize_norms_and_biases(hf)
    assert_matches_transformers(config["vocab_size"], hf, ModelConfig.from_hf(config), plan=plan)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_a_starved_expert_in_a_group_is_decayed_as_transformers_decays_it(model_type: str) -> None:
    from test_moe import _hf_model, _starve_last_expert
    extra = {"num_local_experts": 5} if model_type == "mixtral" else {"num_experts": 5}
    config, hf = _hf_model(model_type, **extra)
    _starve_last_expert(hf)
    starved = hf.model.layers[0].mlp.experts.down_proj[-1].detach().clone()
    assert_matches_transformers(config.vocab_size, hf, ModelConfig.from_hf(config.to_dict()),
                                plan=Plan(micro_batch_size=2, loss_chunk_tokens=16, expert_group_size=2))
    decay = (1 - 1e-3 * 0.1) ** 3  # no gradient, decayed by AdamW all the same (in its own group of one)
    torch.testing.assert_close(hf.model.layers[0].mlp.experts.down_proj[-1].detach(), starved * decay)


@settings(max_examples=examples(30), deadline=None)
@given(family=st.sampled_from(["qwen3_moe", "qwen2_moe", "mixtral"]), experts=st.integers(2, 6),
       top_k=st.integers(1, 3), group=st.integers(1, 6), micro=st.sampled_from([1, 2, 4]),
       checkpoints=st.sampled_from(["device", "host"]), tile=st.sampled_from([None, 5]),
       eager=st.booleans())
def test_expert_groups_train_as_the_whole_layer(family: str, experts: int, top_k: int, group: int, micro: int,
                                                checkpoints: str, tile: int | None, eager: bool) -> None:
    top_k = min(top_k, experts)
    config = _config(family, experts, top_k)
    if family == "mixtral":
        config["num_local_experts"] = config.pop("num_experts")
    clip = None if eager else 1.0
    base = Plan(micro_batch_size=micro, checkpoints=checkpoints, attention_tile_tokens=tile, loss_chunk_tokens=8,
                optimizer_mode="eager" if eager else "deferred", host_grad_slabs=1)
    whole = _train(config, base, clip=clip)
    grouped = _train(config, base.replace(expert_group_size=group), clip=clip)
    # bits where a token's gradient sums at most three nonzero terms (two experts and the router, no shared expert)
    _assert_same(whole, grouped, bitwise=tile is None and top_k <= 2 and family != "qwen2_moe")


def test_the_schedule_holds_at_most_k_parts_and_loads_each_part_once_per_pass() -> None:
    config = _config(experts=6)
    plan = Plan(num_slots=3, prefetch_depth=2, micro_batch_size=2, expert_group_size=2)
    _, _, _, engine, log, _ = _train(config, plan, log=True)
    k, layers = plan.num_slots, config["num_hidden_layers"]
    resident: set = set()
    for i, e in enumerate(log):
        if e.op == "h2d":
            resident.add((e.step, e.load))
            assert len(resident) <= k, f"{len(resident)} loads resident with {k} slots"
            if e.step > 1:  # the next step's load of any part waits for the block's update
                assert any(x.op == "adam_end" and x.step == e.step - 1 and x.block == e.block for x in log[:i])
        elif e.op == "release":
            resident.remove((e.step, e.load))
        elif e.op == "compute":
            h2d = [x for x in log[:i] if x.op == "h2d" and x.step == e.step and x.load == e.load]
            assert len(h2d) == 1 and h2d[0].slot == e.slot and h2d[0].part == e.part
    for step in (1, 2, 3):
        parts = [(e.block, e.phase, e.part) for e in log if e.op == "h2d" and e.step == step and e.part >= 0]
        for b in range(1, layers + 1):
            # forward: the dense part, then 3 groups; backward: the dense part, the groups, the dense part again
            assert [(p, q) for (x, p, q) in parts if x == b] == [("fwd", 0), ("fwd", 1), ("fwd", 2), ("fwd", 3),
                                                                 ("bwd", 0), ("bwd", 1), ("bwd", 2), ("bwd", 3),
                                                                 ("bwd", 0)]
        submits = [e.block for e in log if e.op == "adam_submit" and e.step == step]
        assert submits == list(range(layers + 2)), "every block updated once per step, in forward order"
    layer_numel = engine.templates.layers[0].layout.numel
    assert engine.executor.slots.buffers[0].numel() < layer_numel
    assert engine.executor.grad_buffers.buffers[0].numel() < layer_numel


def test_spilled_gradients_are_refused_in_one_line(tmp_path) -> None:
    plan = Plan(spill="all", spill_dir=str(tmp_path), expert_group_size=2)
    with pytest.raises(ConfigError, match="expert_group_size") as err:
        Engine(ModelConfig.from_hf(_config()), OptimizerConfig(max_grad_norm=1.0), plan=plan,
               compute_dtype=torch.float32, device="cpu")
    assert "\n" not in str(err.value)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("megatrain-io")]  # its I/O stopped


def test_a_dense_model_ignores_the_group_size() -> None:
    config = {"model_type": "qwen3", **TINY}
    whole = _train(config, Plan(micro_batch_size=2), steps=1)
    grouped = _train(config, Plan(micro_batch_size=2, expert_group_size=2), steps=1)
    _assert_same(whole, grouped, bitwise=True)


def test_slot_formula_by_hand_for_qwen3_235b() -> None:
    """h 4096, I 1536, E 128, V 151936: embedding 151936 x 4096 = 622329856, head 4096 + 622329856 = 622333952;
    experts X = 128 x 3 x 1536 x 4096 = 2415919104 of a 2487755008-element layer, so the dense part D =
    71835904; a group of 32: 32 x 2 x 1536 x 4096 + 32 x 4096 x 1536 = 603979776; of 64: 1207959552."""
    shape = model_shapes.resolve("shape:Qwen3-235B-A22B")
    assert shape.numel_layer == 2487755008 and shape.experts.experts_numel(4096) == 2415919104
    plan = Plan(expert_group_size=32)
    assert memory_model.slot_numel(shape, plan) == (622333952, "Bu")  # the head is the largest unit
    assert memory_model.slot_numel(shape, plan.replace(expert_group_size=64)) == (1207959552, "Bu")
    assert memory_model.slot_numel(shape, plan.replace(expert_group_size=None)) == (2487755008, "Bmax")
    assert shape.experts.group_numel(4096, 48) == 48 * 3 * 1536 * 4096  # 128 = 48 + 48 + 32: a whole group
    work = Workload(seq_len=4096, batch=8, compute_dtype="bfloat16")
    mem = memory_model.estimate(shape, work, plan, preset("H100-SXM", "server-2t"))
    slots = next(c for c in mem.components if c.name == "weight slots")
    assert slots.nbytes == 2 * 622333952 * 2
    routed = next(c for c in mem.components if c.name == "expert-group routed state")
    # forward (the larger pass): h, the routed tokens and their sum, bf16 weights, the sorted pairs; each
    # micro-batch's 128 expert ends
    M = work.micro_batches(min(plan.micro_batch_size, work.batch))
    assert routed.nbytes == 32768 * (3 * 4096 * 2 + 8 * (2 + 16)) + M * 4 * 128


def test_megatrain_plan_shows_the_group_size(capsys) -> None:
    from megatrain.planner.commands import cli
    argv = ["plan", "--model", "shape:Qwen3-235B-A22B", "--hardware", "H100-SXM", "--host", "server-2t", "--seq-len",
            "4096", "--batch", "8", "--spill", "none", "--ram", "8T"]
    assert cli.main(argv + ["--gpu-mem", "24G"]) == 0
    out = capsys.readouterr().out
    assert "experts in groups of 32" in out and "K x Bu x c" in out
    # room for a whole layer, and for its fp32 copy on the way to the slot where the device rounds the weights
    assert cli.main(argv + ["--gpu-mem", "160G"]) == 0
    assert "experts streamed with their whole layer" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_expert_groups_with_the_balance_loss_and_sliding_layers_train_as_the_whole_layer(family: str) -> None:
    """The dense part routes under the forward's observer once per layer (counts and the loss's statistics), its
    autograd recompute takes the load-balancing gradient, and each layer type's dense part is its own template."""
    config = _config(family, experts=4, top_k=2, output_router_logits=True, router_aux_loss_coef=0.3,
                     use_sliding_window=True, sliding_window=5, max_window_layers=2)
    if family == "qwen3_moe":
        config.pop("max_window_layers")
    base = Plan(micro_batch_size=2, loss_chunk_tokens=8)
    whole, grouped = _train(config, base), _train(config, base.replace(expert_group_size=1))
    assert whole[3].routing is not None and grouped[3].routing is not None
    torch.testing.assert_close(grouped[3].routing.tokens, whole[3].routing.tokens, rtol=0, atol=0)
    _assert_same(whole, grouped, bitwise=False)
    off = _train({**config, "router_aux_loss_coef": 0.0}, base.replace(expert_group_size=1))
    assert off[0][1] != grouped[0][1], "the loss's gradient changes the second step"
