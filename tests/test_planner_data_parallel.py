"""The planner's data-parallel terms: one rank's memory and the collectives, checked by hand; the runtime's
per-rank host store against the planner's per-rank state (allocated bytes, 2 CPU ranks)."""
from __future__ import annotations

import json

import pytest
import torch

from megatrain.planner.commands import cli, report
from megatrain.planner.costs import data_parallel, memory_model
from megatrain.planner.costs.cost_model import PhaseTime
from megatrain.planner.profiling import hardware
from megatrain.planner.choice import search
from megatrain.planner.shapes.model_shapes import PRESETS, from_config
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload, WorkloadError
from megatrain.runtime import Engine, ModelConfig
from rank_processes import run_ranks

H100 = hardware.preset("H100-SXM")
PLAN = Plan(num_slots=2, prefetch_depth=1, micro_batch_size=1, optimizer_mode="deferred", device_grad_buffers=2)


def _by_name(est: memory_model.MemoryEstimate) -> dict[tuple[str, str], int]:
    return {(c.where, c.name): c.nbytes for c in est.components}


def test_one_ranks_memory_by_hand() -> None:
    m = PRESETS["shape:Llama-3.1-8B"]
    work = Workload(seq_len=4096, batch=16, compute_dtype="bf16")
    topo = data_parallel.topology(H100, 8, 1)
    got = _by_name(data_parallel.memory(m, work, PLAN, H100, topo))
    single = _by_name(memory_model.estimate(m, Workload(seq_len=4096, batch=2, compute_dtype="bf16"), PLAN, H100))
    emb, layer, head = 128256 * 4096, 218_112_000, 4096 + 128256 * 4096
    shard = lambda n: -(-(-(-n // 8)) // 64) * 64  # noqa: E731  align64(ceil(n / 8))
    NW = shard(emb) + 32 * shard(layer) + shard(head)
    assert got[("host", "fp32 master")] == 4 * NW == got[("host", "Adam m")] == got[("host", "Adam v")]
    assert got[("host", "compute-dtype shadow")] == 2 * NW
    assert got[("host", "fp32 grads (full arena)")] == 4 * NW
    assert got[("device", "gradient shards")] == 3 * shard(head) * 4
    # Activations are the rank's batch (2 of 16 sequences): as one process with batch 2.
    for key in [("device", "weight slots"), ("device", "activation grad"), ("device", "activation checkpoints"),
                ("device", "logits chunk")]:
        assert got[key] == single[key], key


def test_a_ranks_resident_blocks_by_hand() -> None:
    """A rank holds and updates its shard of a resident block: 16 x align64(ceil(n / W)) bytes on its GPU, and its
    device update (deferred: after backward) takes that shard's 28 bytes a parameter at the device AdamW's rate, and 8
    more with clipping (the gradient multiplied by the clip coefficient)."""
    from megatrain.planner.costs import cost_model, resident_blocks
    m = PRESETS["shape:Llama-3.2-1B"]
    work = Workload(seq_len=2048, batch=16, compute_dtype="bf16")
    plan = PLAN.replace(resident_blocks=(0, 1, 2))
    W = 8
    shard = lambda n: -(-(-(-n // W)) // 64) * 64  # noqa: E731  align64(ceil(n / W))
    numels = [m.numel_embedding, m.numel_layer, m.numel_layer]
    got = _by_name(data_parallel.memory(m, work, plan, H100, data_parallel.topology(H100, W, 1)))
    assert got[("device", "resident optimizer state")] == 16 * sum(shard(n) for n in numels)
    rank = data_parallel.rank_workload(work, data_parallel.topology(H100, W, 1))
    whole, sharded = (cost_model.estimate(m, rank, plan, H100, world) for world in (1, W))
    rate = resident_blocks.DEVICE_ADAM_GBPS * 1e9
    saved = sum((28 + 8) * (n - shard(n)) for n in numels) / rate  # clipping: the gradient's multiply too
    assert whole.backward.compute_s - sharded.backward.compute_s == pytest.approx(saved, rel=1e-9)


def test_collectives_time_by_hand() -> None:
    """With a bandwidth far below everything else, the step is the collectives: r x bytes / bw per phase."""
    m = PRESETS["shape:Llama-3.1-8B"]
    work = Workload(seq_len=4096, batch=16, compute_dtype="bf16")
    topo = data_parallel.topology(H100, 4, 2, intra_gbps=300.0, network_gbps=0.4)  # 0.1 GB/s per rank
    assert topo.bus_gbps == pytest.approx(0.1)
    s = data_parallel.scaling(m, work, PLAN, H100, topo)
    N, L, layer = m.numel_total, 32, m.numel_layer
    lat = 34 * data_parallel.COLLECTIVE_LATENCY_S["gpu"]
    fwd = lat + 7 / 8 * 2 * N / 0.1e9
    bwd = lat + 7 / 8 * (2 * L * layer + 4 * N) / 0.1e9
    assert s.comm_seconds == pytest.approx(fwd + bwd)
    assert s.step_seconds == pytest.approx(fwd + bwd, rel=0.02)  # everything else is hidden under them
    assert s.efficiency < 0.05


def test_the_collective_timeout_is_the_plans_bound_by_hand() -> None:
    """max(120 s, 20 x the rank's predicted step + its master, m and v written at the disk's rate)."""
    m = PRESETS["shape:Llama-3.1-8B"]
    work = Workload(seq_len=4096, batch=128, compute_dtype="bf16")  # 16 sequences per rank: a step of seconds
    topo = data_parallel.topology(H100, 8, 1)
    step = data_parallel.scaling(m, work, PLAN, H100, topo).step_seconds
    state = sum(c.nbytes for c in data_parallel.memory(m, work, PLAN, H100, topo).components
                if c.name in ("fp32 master", "Adam m", "Adam v"))
    assert state == 3 * 4 * sum(data_parallel.shard_numel(n, 8) for n in data_parallel.block_numels(m))
    got = data_parallel.collective_timeout_s(m, work, PLAN, H100, topo)
    assert got == pytest.approx(max(120.0, 20 * step + state / (H100.disk_write_gbps * 1e9)))
    assert got > 120.0  # the plan's bound, above the floor
    tiny = from_config(dict(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    assert data_parallel.collective_timeout_s(tiny, Workload(seq_len=8, batch=2, compute_dtype="fp32"), PLAN, H100,
                                              data_parallel.topology(H100, 2, 1)) == 120.0  # the floor


def test_one_rank_is_the_single_process_and_more_ranks_scale_below_one() -> None:
    m = PRESETS["shape:Llama-3.1-8B"]
    work = Workload(seq_len=4096, batch=16, compute_dtype="bf16")
    one = data_parallel.scaling(m, work, PLAN, H100, data_parallel.topology(H100, 1, 1))
    assert one.efficiency == 1.0 and one.comm_seconds == 0.0
    for g in (2, 4, 8):
        s = data_parallel.scaling(m, work, PLAN, H100, data_parallel.topology(H100, g, 1))
        assert 0 < s.efficiency <= 1.0 and s.speedup > 1.0
    with pytest.raises(WorkloadError, match="does not divide among 3 ranks"):
        data_parallel.rank_workload(work, data_parallel.topology(H100, 3, 1))


def test_plan_command_reports_ranks(capsys) -> None:
    assert cli.main(["plan", "--model", "shape:Llama-3.1-8B", "--seq-len", "4096", "--batch", "16", "--hardware",
                    "H100-SXM",
                     "--gpus-per-node", "8", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "data parallel: 16 ranks (8 per node x 2 nodes), 1 sequences per rank" in out
    assert "scaling efficiency" in out and "per node: host RAM" in out
    assert out.count("TOTAL") == 3 and "one rank of 16" in out  # the rank's memory, once


def test_a_ranks_time_table_shows_its_collectives_and_what_bounds_it(capsys) -> None:
    """The rank's phases with a collectives column (``collective_seconds``, by hand above); at 32 ranks on
    network-bound nodes they bound the step, and the page and its JSON say so; hours per billion tokens count
    every rank's tokens."""
    m = PRESETS["shape:Llama-3.1-8B"]
    args = ["plan", "--model", "shape:Llama-3.1-8B", "--seq-len", "1024", "--batch", "64", "--hardware", "H200",
            "--gpus-per-node", "8", "--nodes", "4"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert cli.main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    hw = hardware.preset("H200")
    topo = data_parallel.topology(hw, 8, 4)
    fwd, bwd = data_parallel.collective_seconds(m, Workload(seq_len=1024, batch=64, compute_dtype="bf16"), hw, topo)
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("phase"))
    assert lines[head].split()[:7] == ["phase", "wall", "compute", "H2D", "D2H", "collectives", "CPU"]
    forward, backward, step = (lines[head + k].split() for k in (2, 3, 4))
    assert " ".join(forward[9:11]) == report.seconds(fwd) and " ".join(backward[9:11]) == report.seconds(bwd)
    assert forward[-1] == backward[-1] == step[-1] == "collectives"
    assert data["bottleneck"] == "collectives" and data["data_parallel"]["collectives_bound"]
    total = data["data_parallel"]["tokens_per_second"]
    assert data["tokens_per_second"] * 32 == pytest.approx(total)
    assert f"{report.seconds(1e9 / total)} per billion tokens on the 32 ranks" in out
    # CPU ranks run their collectives one after another with the rest (data_parallel): they never bind alone.
    phase = PhaseTime(3.0, 1.0, 0.0, 0.0, 0.5)
    assert report.bound_by(phase, 2.0) == "collectives" and report.bound_by(phase, 2.0, True) == phase.bottleneck


CONFIG = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2)


def _store_bytes(rank: int, world: int) -> int:
    with Engine(ModelConfig(**CONFIG), plan=PLAN, compute_dtype=torch.bfloat16, device="cpu") as engine:
        return engine.store.nbytes


def test_a_ranks_host_store_is_a_wth_and_the_planners(tmp_path) -> None:
    single = _store_bytes(0, 1)
    ranks = run_ranks(_store_bytes, 2, tmp_path)
    model = from_config({**CONFIG, "model_type": "llama"})
    topo = data_parallel.topology(hardware.preset("H100-SXM"), 2, 1)
    predicted = _by_name(data_parallel.memory(model, Workload(seq_len=16, batch=2, compute_dtype="bf16"), PLAN,
                                              hardware.preset("H100-SXM"), topo))
    state = sum(predicted[("host", n)] for n in data_parallel.STATE_COMPONENTS)
    for got in ranks:
        assert abs(got / single - 0.5) < 0.01, (got, single)
        assert abs(got - state) <= 0.10 * state, (got, state)


def test_the_search_judges_a_node_of_ranks_against_its_host_ram() -> None:
    """8 ranks share a 160 GiB node: one rank's plan with the checkpoints and all of its state in host RAM fits the
    host as if it were alone (what planning the rank's batch as one process answers), but 8 of them do not; the
    search moves the checkpoints to the GPU or keeps some blocks' state there, and the node's RAM (8 x one rank's
    host bytes, by hand) fits."""
    m = PRESETS["shape:Llama-3.1-8B"]
    hw = H100.with_overrides(ram_bytes=160 * hardware.GiB)
    work = Workload(seq_len=4096, batch=64, compute_dtype="bf16", spill="none")
    topo = data_parallel.topology(hw, 8, 1)
    alone = search.search(m, data_parallel.rank_workload(work, topo), hw).require()
    assert alone.plan.checkpoints == "host"
    best = search.search(m, work, hw, topo).require()
    assert best.plan.checkpoints == "device" or best.plan.resident_blocks
    assert 8 * best.memory.host_bytes <= hw.host_budget_bytes
    on_host = data_parallel.memory(m, work, best.plan.replace(checkpoints="host", resident_blocks=()), hw, topo)
    assert on_host.host_bytes <= hw.host_budget_bytes < 8 * on_host.host_bytes
    assert [o.budget for o in search.overruns(on_host, work, hw, topo)] == ["host RAM"]
    # The rank's plan is for its share of the batch: the runtime checks the workload it was made for.
    assert best.plan.workload == data_parallel.rank_workload(work, topo).fingerprint(m)
