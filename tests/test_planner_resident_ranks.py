"""Optimizer state on the GPUs of data-parallel ranks: the search offers resident blocks to a rank's plan
([Note: resident trade] in planner/choice/plan_variants.py), its memory holds each resident block's shard (16 x
align64(ceil(n / W)) bytes), its step saves its shards' copies and CPU update (data_parallel.rank_cost, by hand),
and the plan it returns runs on two gloo ranks with the host path's losses."""
from __future__ import annotations

import pytest

from megatrain.planner.costs import cost_model, data_parallel, resident_blocks
from megatrain.planner.costs.spill_placement import block_numels
from megatrain.planner.choice import search
from megatrain.planner.profiling.hardware import GiB, HardwareProfile
from megatrain.planner.shapes import model_shapes
from megatrain.planner.shapes.workload import Workload

HF = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2}
MODEL = model_shapes.from_config(HF, name="tiny")
# A GPU with room for every block's state, beside a host whose CPU AdamW is slow: the update is the step's
# bottleneck unless it leaves the CPU.
GPU = HardwareProfile(gpu_name="test GPU", gpu_mem_bytes=8 * GiB, h2d_gbps=20.0, d2h_gbps=20.0, duplex_gbps=30.0,
                      matmul_tflops={"float32": 50.0, "bfloat16": 200.0}, cpu_adam_params_per_s=1e5,
                      host_ram_bytes=64 * GiB, host_available_bytes=60 * GiB, cores=8)
WORK = Workload(16, 4, "fp32")  # clipping: deferred updates
EVERY = tuple(range(MODEL.num_layers + 2))


def _shard(n: int, world: int) -> int:
    """align64(ceil(n / W)), by hand."""
    return -(-(-(-n // world)) // 64) * 64


def test_the_search_keeps_a_ranks_optimizer_state_on_its_gpu() -> None:
    """Two ranks on one node: every block's state fits beside the step, so the rank's plan keeps all of it on the
    GPU (only one process was offered this before), and its memory holds each block's shard: 16 x Nr_W bytes."""
    topo = data_parallel.topology(GPU, 2, 1, intra_gbps=100.0)
    best = search.search(MODEL, WORK, GPU, topo).require()
    assert best.plan.resident_blocks == EVERY
    resident = 16 * sum(_shard(n, 2) for n in block_numels(MODEL))
    for mem in (best.memory, data_parallel.memory(MODEL, WORK, best.plan, GPU, topo)):
        rows = {c.name: c for c in mem.components}
        assert rows["resident optimizer state"].where == "device"
        assert rows["resident optimizer state"].nbytes == resident
        assert "fp32 master" not in rows or rows["fp32 master"].nbytes == 0  # nothing of theirs in host RAM
    # The same plan with its state in host RAM is slower by the CPU AdamW it then waits for.
    host = data_parallel.rank_cost(MODEL, WORK, best.plan.replace(resident_blocks=()), GPU, topo)
    assert best.cost.step_seconds < host.step_seconds
    # A CPU device keeps none (its ranks have no GPU to hold them), nor does bf16 AdamW state.
    cpu = GPU.replace(gpu_name="cpu", gpu_mem_bytes=0)
    assert not search.search(MODEL, WORK, cpu, data_parallel.topology(cpu, 2, 1)).require().plan.resident_blocks
    bf16 = Workload(16, 4, "fp32", optimizer_state="bf16")
    assert not search.search(MODEL, bf16, GPU, topo).require().plan.resident_blocks


@pytest.mark.parametrize("gpus_per_node,nodes", [(2, 1), (2, 2), (1, 2)])
def test_a_ranks_resident_blocks_save_its_shards_copies_and_cpu_update_by_hand(gpus_per_node: int,
                                                                                nodes: int) -> None:
    """W ranks, G to a node: without resident blocks a rank copies 1 / W of the weights in and the gradients out
    and runs AdamW on its shard with the node's cores shared by G ranks, N x G / (W x AdamW params/s); with every
    block resident it copies nothing and adds its shards' device updates, (28 + 8 with clipping) x Nr_W bytes at
    the device AdamW's GB/s. AdamW bounds this step, so the step is shorter by about that update less the device's."""
    topo = data_parallel.topology(GPU, gpus_per_node, nodes, intra_gbps=100.0)
    W, G = topo.world, gpus_per_node
    plan = search.search(MODEL, WORK, GPU, topo).require().plan.replace(checkpoints="device", checkpoint_piece_tokens=None)
    host = data_parallel.rank_cost(MODEL, WORK, plan.replace(resident_blocks=()), GPU, topo)
    every = data_parallel.rank_cost(MODEL, WORK, plan.replace(resident_blocks=EVERY), GPU, topo)
    m = MODEL
    E, layer, H = m.numel_embedding, m.numel_layer, m.numel_head
    # fp32 weights: the embedding once, each layer in forward and backward, the head; fp32 gradients once each
    assert host.h2d_bytes == pytest.approx(4 * (E + 2 * m.num_layers * layer + H) / W)
    assert host.d2h_bytes == pytest.approx(4 * (E + m.num_layers * layer + H) / W)
    assert every.h2d_bytes == 0 == every.d2h_bytes
    cpu_update = m.numel_total * G / (W * GPU.cpu_adam_params_per_s)
    assert host.forward.adam_s == pytest.approx(cpu_update, rel=1e-12)  # deferred: before the next forward
    assert every.forward.adam_s == 0 == every.backward.adam_s == every.optimizer_exposed_seconds
    single = cost_model.estimate(m, data_parallel.rank_workload(WORK, topo), plan.replace(resident_blocks=()), GPU)
    shed = m.numel_total / GPU.cpu_adam_params_per_s - cpu_update  # the rank's shard of the update
    assert host.optimizer_exposed_seconds == pytest.approx(single.optimizer_exposed_seconds - shed, rel=1e-9)
    # 28 bytes a parameter, 8 more with clipping (the gradient multiplied by the clip coefficient)
    device_update = 36 * sum(_shard(n, W) for n in block_numels(m)) / (resident_blocks.DEVICE_ADAM_GBPS * 1e9)
    assert every.backward.compute_s - host.backward.compute_s == pytest.approx(device_update, rel=1e-9)
    assert host.step_seconds - every.step_seconds == pytest.approx(cpu_update - device_update, rel=0.02)


def _rank_steps(rank: int, world: int, plans: list, seq: int, rows: int) -> list[list[float]]:
    """Each plan's losses over 2 steps on this rank's rows of the same batches (fp32, clipping on)."""
    import torch

    from megatrain.runtime import Engine, ModelConfig, OptimizerConfig

    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, HF["vocab_size"], (rows * world, seq), generator=gen) for _ in range(2)]
    mine = slice(rank * rows, (rank + 1) * rows)
    out = []
    for plan in plans:
        with Engine(ModelConfig.from_hf(HF), OptimizerConfig(lr=1e-2, max_grad_norm=1.0), plan=plan,
                    compute_dtype=torch.float32, device="cpu", seed=3) as engine:
            out.append([engine.step(ids[mine], ids[mine]).item() for ids in batches])
    return out


def test_the_plan_the_search_gives_two_ranks_runs_on_two_gloo_ranks(tmp_path) -> None:
    """The runtime's own checks take the rank's plan with every block resident (the engine's arguments, the plan's
    workload, the resident blocks against the model's blocks), and its two ranks train the losses of the same plan
    with the state in host RAM."""
    from rank_processes import run_ranks

    topo = data_parallel.topology(GPU, 2, 1, intra_gbps=100.0)
    plan = search.search(MODEL, WORK, GPU, topo).require().plan
    assert plan.resident_blocks == EVERY and plan.workload is not None
    for resident, host in run_ranks(_rank_steps, 2, tmp_path, [plan, plan.replace(resident_blocks=())],
                                    WORK.seq_len, WORK.batch // 2):
        assert resident == host
