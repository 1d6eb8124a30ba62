"""Where a bf16 step's weights are rounded from the fp32 master (``Plan.weights_cast``): a compute-dtype shadow
in RAM that AdamW refreshes and the loads copy ("host"), or the master itself copied and rounded on the device
("device"). The same numbers either way; the planner's memory, traffic and AdamW terms checked by hand."""
from __future__ import annotations

import pytest
import torch

from megatrain.planner.costs import adam_time, cost_model, memory_model, step_traffic
from megatrain.planner.shapes import model_shapes
from megatrain.planner.choice import search
from megatrain.planner.profiling.hardware import preset
from megatrain.plan.plan import Plan
from megatrain.plan.plan_checks import PlanError
from megatrain.planner.shapes.workload import Workload
from megatrain.runtime import Engine, ModelConfig, OptimizerConfig
from rank_processes import run_ranks

HF = dict(model_type="llama", vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
          num_attention_heads=6, num_key_value_heads=2)


def _train(plan: Plan, clip: float | None, steps: int = 3,
           device: str = "cpu") -> tuple[list[float], dict[str, torch.Tensor], Engine, int]:
    """Losses, weights and AdamW moments after ``steps`` steps, the engine (closed) and its pinned bytes while open."""
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, HF["vocab_size"], (4, 16), generator=gen) for _ in range(steps)]
    with Engine(ModelConfig.from_hf(HF), OptimizerConfig(lr=1e-3, max_grad_norm=clip), plan=plan,
                compute_dtype=torch.bfloat16, device=device, seed=3) as engine:
        losses = [engine.step(ids, ids).item() for ids in batches]
        state = {k: v.clone() for k, v in engine.state_dict().items()}
        moments = engine.optimizer_state_dict()
        pinned = engine.store.pinned_bytes
    state.update({f"{k}.{m}": t.clone() for k, d in moments.items() for m, t in d.items()})
    return losses, state, engine, pinned


@pytest.mark.parametrize("mode, clip", [("deferred", 1.0), ("eager", None)])
def test_cast_on_the_device_trains_the_same_bits(mode: str, clip: float | None) -> None:
    """The rounding moves from AdamW's shadow refresh to the load's copy; fp32 to bf16 rounds the same either way,
    so every loss, weight and moment is the same bit for bit, and the store holds no shadow."""
    host_losses, host_state, host, _ = _train(Plan(optimizer_mode=mode, micro_batch_size=2), clip)
    dev_losses, dev_state, dev, _ = _train(Plan(optimizer_mode=mode, micro_batch_size=2, weights_cast="device"), clip)
    assert host_losses == dev_losses
    assert host_state.keys() == dev_state.keys()
    assert all(torch.equal(host_state[k], dev_state[k]) for k in host_state)
    assert host.store.shadow is not host.store.master and dev.store.shadow is dev.store.master
    names = {a.name: a.crosses_pcie for a in dev.store.arenas()}
    assert names["fp32 master"] and "shadow" not in names  # the master is what travels, and is pinned with CUDA
    assert dev.store.nbytes == host.store.nbytes - host.store.shadow.nbytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode, clip", [("deferred", 1.0), ("eager", None)])
def test_cast_on_a_gpu_trains_the_same_bits(mode: str, clip: float | None) -> None:
    """On CUDA the load copies the pinned fp32 master and ``copy_`` rounds it on the GPU (round to nearest even, as
    the CPU's rounding into the shadow): the same losses and state, and the master registered instead of a shadow."""
    host_losses, host_state, host, host_pinned = _train(Plan(optimizer_mode=mode, micro_batch_size=2), clip,
                                                        device="cuda")
    dev_losses, dev_state, dev, dev_pinned = _train(Plan(optimizer_mode=mode, micro_batch_size=2,
                                                         weights_cast="device"), clip, device="cuda")
    assert host_losses == dev_losses
    assert all(torch.equal(host_state[k].cpu(), dev_state[k].cpu()) for k in host_state)
    assert dev_pinned == host_pinned - host.store.shadow.nbytes + dev.store.master.nbytes > 0


def _rank_casts(rank: int, world: int) -> dict[str, tuple]:
    """This rank's losses and final weights with each cast: its shard of the master rounded into its shadow, or
    copied and rounded on the way into its part of the slot before the all-gather."""
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    out = {}
    for cast in ("host", "device"):
        gen = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, HF["vocab_size"], (4, 16), generator=gen) for _ in range(2)]
        with Engine(ModelConfig.from_hf(HF), OptimizerConfig(lr=1e-3, max_grad_norm=1.0),
                    plan=Plan(micro_batch_size=1, weights_cast=cast), compute_dtype=torch.bfloat16, device="cpu",
                    seed=3) as engine:
            assert engine.topology is not None and engine.topology.world_size == world  # sharded, not replicated
            losses = [engine.step(ids[rows], ids[rows]).item() for ids in batches]
            out[cast] = (losses, engine.state_dict())
    return out


def test_ranks_cast_on_the_device_as_on_the_host(tmp_path) -> None:
    for rank in run_ranks(_rank_casts, 2, tmp_path):
        (host_losses, host_state), (dev_losses, dev_state) = rank["host"], rank["device"]
        assert host_losses == dev_losses
        assert all(torch.equal(host_state[k], dev_state[k]) for k in host_state)


def test_cast_on_the_device_resumes_bitwise(tmp_path) -> None:
    """Three steps, a checkpoint, three more from it: the same weights as six straight (no shadow to restore)."""
    plan = Plan(micro_batch_size=2, weights_cast="device")
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, HF["vocab_size"], (4, 16), generator=gen) for _ in range(6)]

    def engine() -> Engine:
        return Engine(ModelConfig.from_hf(HF), OptimizerConfig(lr=1e-3, max_grad_norm=1.0), plan=plan,
                      compute_dtype=torch.bfloat16, device="cpu", seed=3)

    with engine() as straight:
        expected = [straight.step(ids, ids).item() for ids in batches], straight.state_dict()
    with engine() as first:
        for ids in batches[:3]:
            first.step(ids, ids)
        first.save_checkpoint(tmp_path, blocking=True)
    with Engine.load_checkpoint(tmp_path) as resumed:
        assert resumed.plan.weights_cast == "device" and resumed.store.shadow is resumed.store.master
        losses = [resumed.step(ids, ids).item() for ids in batches[3:]]
        weights = resumed.state_dict()
    assert losses == expected[0][3:]
    assert all(torch.equal(expected[1][k], weights[k]) for k in weights)


def test_plan_refuses_a_cast_on_the_device_of_a_spilled_master() -> None:
    with pytest.raises(PlanError, match="weights_cast='device'.*master spills"):
        Plan(weights_cast="device", spill="all", spill_dir="/tmp")
    with pytest.raises(PlanError, match="weights_cast='device'.*master spills"):
        Plan(weights_cast="device", spill="blocks", spill_dir="/tmp", spill_blocks={"master": [1]})
    with pytest.raises(PlanError, match="weights_cast="):
        Plan(weights_cast="gpu")
    Plan(weights_cast="device", spill="optimizer", spill_dir="/tmp")  # m and v on disk: the master stays in RAM
    Plan(weights_cast="device", spill="blocks", spill_dir="/tmp", spill_blocks={"exp_avg": [0]})


def test_memory_and_traffic_by_hand() -> None:
    """Llama-3.2-1B's shape in bf16 on an H200: no shadow (2 x N less RAM), the master pinned instead of it, one
    fp32 block on the device on its way to a slot, and 4 instead of 2 bytes a weight over PCIe."""
    model = model_shapes.resolve("shape:Llama-3.2-1B")
    work = Workload(2048, 8, compute_dtype="bf16")
    hw = preset("H200", "workstation-128g")
    host, dev = Plan(micro_batch_size=4), Plan(micro_batch_size=4, weights_cast="device")
    N, Bmax = model.numel_total, model.numel_largest_block  # 1,235,814,400 and the tied table, 262,668,288
    a, b = memory_model.estimate(model, work, host, hw), memory_model.estimate(model, work, dev, hw)
    terms_a, terms_b = ({c.name: c for c in m.components} for m in (a, b))
    assert terms_a["compute-dtype shadow"].nbytes == 2 * N and "compute-dtype shadow" not in terms_b
    assert not terms_a["fp32 master"].pinned and terms_b["fp32 master"].pinned
    assert terms_b["weight cast staging"].nbytes == Bmax * 4 and "weight cast staging" not in terms_a
    assert a.pinned_host_bytes - 2 * N == b.pinned_host_bytes - 4 * N  # the gradients' arena in both
    assert b.host_bytes == a.host_bytes - 2 * N
    E, L, Lw, H = model.numel_embedding, model.num_layers, model.numel_layer, model.numel_head
    weights = E + 2 * L * Lw + H + E  # tied: the table loads again with the head
    assert step_traffic.traffic(model, work, host) == (weights * 2, (L * Lw + E) * 4)
    assert step_traffic.traffic(model, work, dev) == (weights * 4, (L * Lw + E) * 4)


def test_no_rounding_pass_on_the_cpu() -> None:
    """The preset has no measured rounding rate, so the host cast's AdamW is ADAM_SHADOW_FACTOR x the bare
    update; with the cast on the device it is the bare update."""
    model = model_shapes.resolve("shape:Llama-3.2-1B")
    work = Workload(2048, 8, compute_dtype="bf16", clipping=False)
    hw = preset("H200", "workstation-128g")
    assert hw.cpu_shadow_params_per_s == 0
    plan = Plan(micro_batch_size=4, optimizer_mode="eager")

    def adam(p: Plan) -> float:
        c = cost_model.estimate(model, work, p, hw)
        return c.forward.adam_s + c.backward.adam_s

    assert adam(plan) == pytest.approx(adam(plan.replace(weights_cast="device")) * adam_time.ADAM_SHADOW_FACTOR)


def test_search_rounds_on_the_device_where_adamw_bounds_the_step() -> None:
    """1B, 8 x 2048 with clipping on an H200: the deferred update outlasts the compute. The search keeps every block's
    optimizer state on the device (no CPU AdamW left to bound the step); without that, the cast on the device takes
    the rounding pass off the CPU update and is the faster plan. On a CPU device there is no PCIe to trade and the
    plan keeps the host cast."""
    model = model_shapes.resolve("shape:Llama-3.2-1B")
    work = Workload(2048, 8, compute_dtype="bf16")
    hw = preset("H200", "workstation-128g")
    best = search.search(model, work, hw).best
    assert best is not None and len(best.plan.resident_blocks) == model.num_layers + 2
    on_host = best.plan.replace(resident_blocks=())
    device = cost_model.estimate(model, work, on_host.replace(weights_cast="device"), hw)
    host = cost_model.estimate(model, work, on_host.replace(weights_cast="host"), hw)
    assert device.step_seconds < host.step_seconds
    assert best.cost.step_seconds < device.step_seconds
    cpu = search.search(model_shapes.from_config(HF), Workload(16, 4, compute_dtype="bf16"),
                        preset("H200", "workstation-128g").replace(gpu_name="cpu", gpu_mem_bytes=0)).best
    assert cpu is not None and cpu.plan.weights_cast == "host"


def test_minimum_host_ram_has_no_shadow_on_a_gpu() -> None:
    """``megatrain-plan size``'s least RAM without NVMe (Llama-3.1-8B, clipping): fp32 master, m, v and the full
    gradient arena, 16 x N, and no 2 x N shadow, since the device can round the weights."""
    model = model_shapes.resolve("shape:Llama-3.1-8B")
    least = search.minimum_memory(model, Workload(4096, 16, compute_dtype="bf16"), preset("H200"))["host_no_spill"]
    terms = {c.name: c.nbytes for c in least.memory.components if c.where == "host"}
    assert least.plan.weights_cast == "device" and "compute-dtype shadow" not in terms
    state = ("fp32 master", "Adam m", "Adam v", "fp32 grads (full arena)")
    assert sum(terms[name] for name in state) == 16 * model.numel_total


def test_the_cast_on_the_device_fits_where_the_shadow_does_not() -> None:
    """Llama-3.1-8B with clipping in 130 GiB of RAM, nothing on disk: master, m, v and gradients take 16 x N
    (119.7 GiB) and a shadow 2 x N (15.0 GiB) more than 95% of it, so with every block's state on the host only the
    plan that rounds on the device fits, and the search tries it as a candidate of its own (beside it, plans that
    keep some blocks' state on the GPU may fit with the shadow on the host)."""
    model = model_shapes.resolve("shape:Llama-3.1-8B")
    work = Workload(4096, 16, compute_dtype="bf16")
    hw = preset("H200", "workstation-128g").with_overrides(ram_bytes=130 * 2**30)
    fit, _ = search.feasible_choices(model, work, hw)
    device = [c for c in fit if c.plan.weights_cast == "device" and c.plan.spill == "none"]
    assert device, [(c.plan.weights_cast, c.plan.spill, c.plan.resident_blocks) for c in fit]
    on_host = device[0].plan.replace(resident_blocks=())
    assert not memory_model.estimate(model, work, on_host, hw).overruns(hw)
    assert memory_model.estimate(model, work, on_host.replace(weights_cast="host"), hw).overruns(hw)
