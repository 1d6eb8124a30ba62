"""Cost model: limiting cases against hand formulas, and the direction of each knob."""
from __future__ import annotations

import dataclasses

import pytest

from megatrain.planner.costs import adam_time, cost_model
from megatrain.planner.profiling import hardware
from megatrain.planner.costs.cost_model import (COPY_LATENCY_S, LAUNCH_BWD_S, LAUNCH_FWD_S, NONMATMUL_FACTOR,
                                                T_HALF_TOKENS)
from megatrain.planner.shapes.model_shapes import PRESETS
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload

M8 = PRESETS["shape:Llama-3.1-8B"]


def _hw(**kw: object) -> hardware.HardwareProfile:
    return hardware.preset("H100-SXM").replace(**kw)


def test_compute_bound_matches_hand_formula() -> None:
    # Links so fast that only compute counts; AdamW so fast it hides.
    hw = _hw(h2d_gbps=1e6, d2h_gbps=1e6, duplex_gbps=2e6, cpu_adam_params_per_s=1e15)
    work = Workload(4096, 8)
    plan = Plan(micro_batch_size=2)
    est = cost_model.estimate(M8, work, plan, hw)
    T, t, M = 8 * 4096, 2 * 4096, 4
    rate = 790e12 * t / (t + T_HALF_TOKENS) / NONMATMUL_FACTOR["gpu"]
    fwd = (M * LAUNCH_FWD_S                                                  # embedding: launches only
           + 32 * (T * M8.layer_flops_fwd(4096) / rate + M * LAUNCH_FWD_S)   # layers
           + T * 6 * 128256 * 4096 / rate + M * 2 * LAUNCH_BWD_S)            # head fwd + bwd, 8192 / 4096 chunks
    bwd = 32 * (T * (M8.layer_flops_fwd(4096) + M8.layer_flops_bwd(4096)) / rate + M * LAUNCH_BWD_S) \
        + M * LAUNCH_BWD_S
    assert est.forward.compute_s == pytest.approx(fwd)
    assert est.backward.compute_s == pytest.approx(bwd)
    assert est.step_seconds == pytest.approx(fwd + bwd, rel=1e-3)
    assert est.bottleneck == "compute"
    assert est.tokens_per_second == pytest.approx(T / est.step_seconds)
    assert est.model_tflops == pytest.approx(6 * M8.matmul_params_active * T / est.step_seconds / 1e12)
    assert est.mfu == pytest.approx(est.model_tflops / 790)


def test_transfer_bound_matches_hand_formula() -> None:
    # Compute nearly free, 1 GB/s links: forward time = every block's H2D.
    hw = _hw(h2d_gbps=1.0, d2h_gbps=1.0, duplex_gbps=2.0, matmul_tflops={"bfloat16": 1e9},
             cpu_adam_params_per_s=1e15)
    work = Workload(128, 1)
    est = cost_model.estimate(M8, work, Plan(), hw)
    E, Lw, H = M8.numel_embedding, M8.numel_layer, M8.numel_head
    h2d_fwd = (E * 2 + 32 * Lw * 2 + H * 2) / 1e9 + 34 * COPY_LATENCY_S
    assert est.forward.h2d_s == pytest.approx(h2d_fwd)
    assert est.forward.seconds == pytest.approx(h2d_fwd, rel=0.01)
    assert est.forward.bottleneck == "H2D"
    # backward: H2D of each layer and D2H of fp32 grads share the link (duplex 2 = 1 + 1: no slowdown)
    d2h_bwd = (32 * Lw * 4 + E * 4) / 1e9 + 33 * COPY_LATENCY_S
    assert est.backward.d2h_s == pytest.approx(d2h_bwd)
    assert est.backward.bottleneck == "D2H"


def test_duplex_limit_slows_both_directions() -> None:
    base = _hw(matmul_tflops={"bfloat16": 1e9}, cpu_adam_params_per_s=1e15)
    work = Workload(128, 1)
    full = cost_model.estimate(M8, work, Plan(), base.replace(duplex_gbps=104.0))
    half = cost_model.estimate(M8, work, Plan(), base.replace(duplex_gbps=52.0))
    assert half.backward.seconds > 1.8 * full.backward.seconds


def test_eager_hides_adam_and_deferred_exposes_it() -> None:
    slow_cpu = _hw(cpu_adam_params_per_s=1e9)
    work = Workload(4096, 16, clipping=False)
    eager = cost_model.estimate(M8, work, Plan(optimizer_mode="eager", micro_batch_size=4), slow_cpu)
    deferred = cost_model.estimate(M8, work, Plan(optimizer_mode="deferred", micro_batch_size=4), slow_cpu)
    adam_total = M8.numel_total * adam_time.ADAM_SHADOW_FACTOR / 1e9          # ~9.2 s
    assert deferred.forward.adam_s == pytest.approx(adam_total)
    assert eager.backward.adam_s == pytest.approx(adam_total)
    assert eager.optimizer_exposed_seconds >= 0 and deferred.optimizer_exposed_seconds >= 0
    # Adam far slower than the step: both are CPU-bound, and the step is at least the AdamW time.
    assert eager.step_seconds >= adam_total * 0.99 and deferred.step_seconds >= adam_total * 0.99


def test_more_micro_batch_tokens_raise_throughput_until_compute_bound() -> None:
    hw = _hw(cpu_adam_params_per_s=1e15)
    small = cost_model.estimate(M8, Workload(1024, 1), Plan(), hw)
    big = cost_model.estimate(M8, Workload(1024, 64), Plan(micro_batch_size=16), hw)
    assert small.forward.bottleneck == "H2D"          # 1k tokens cannot hide a weight pass
    assert big.tokens_per_second > 5 * small.tokens_per_second   # 64x the tokens per weight pass, until compute
    assert big.forward.bottleneck == "compute"
    # The ceiling: 6N counted / ~8N run (recompute), so MFU stays below 0.8.
    assert big.mfu < 0.8


def test_host_checkpoints_cost_traffic_not_correctness() -> None:
    hw = _hw()
    work = Workload(4096, 32)
    dev = cost_model.estimate(M8, work, Plan(micro_batch_size=4, checkpoints="device"), hw)
    host = cost_model.estimate(M8, work, Plan(micro_batch_size=4, checkpoints="host"), hw)
    ckpt = 32 * 4096 * 4096 * 2                    # T x h x c per layer
    rate = 52e9 * 90 / 104                         # both directions busy: each at duplex / (h2d + d2h)
    head_grads = M8.numel_head * 4                 # the untied head drains its fp32 grads in forward
    expected = 32 * (ckpt / rate + COPY_LATENCY_S) + head_grads / rate + COPY_LATENCY_S
    assert host.forward.d2h_s == pytest.approx(expected)
    assert host.step_seconds >= dev.step_seconds * 0.999


def test_cpu_device_serialises_adam_at_one_threads_rate() -> None:
    """Where the device is the CPU, AdamW is exposed whole and runs on one thread (the runtime's worker leaves the
    cores to compute): the measured one-thread rate, else the all-core rate over the cores."""
    cpu = hardware.HardwareProfile(gpu_name="cpu", gpu_mem_bytes=0, h2d_gbps=10, d2h_gbps=10, duplex_gbps=10,
                                   matmul_tflops={"float32": 0.1, "bfloat16": 0.1}, cpu_adam_params_per_s=1e9,
                                   host_ram_bytes=64 << 30, host_available_bytes=60 << 30, cores=2)
    m = PRESETS["shape:Qwen2.5-0.5B"]
    est = cost_model.estimate(m, Workload(256, 2), Plan(), cpu)
    assert est.optimizer_exposed_seconds == pytest.approx(m.numel_total * adam_time.ADAM_SHADOW_FACTOR / 0.5e9)
    measured = cpu.replace(adam_by_threads=((1, 0.6e9), (2, 1e9)))
    est = cost_model.estimate(m, Workload(256, 2), Plan(), measured)
    assert est.optimizer_exposed_seconds == pytest.approx(m.numel_total * adam_time.ADAM_SHADOW_FACTOR / 0.6e9)
    gpu = measured.replace(gpu_mem_bytes=80 << 30)  # a GPU machine's worker has every core
    assert gpu.adam_params_per_s == 1e9
    # On the compute thread (Plan.adam_thread) AdamW has every core: the all-core rate, measured one-thread or not.
    est = cost_model.estimate(m, Workload(256, 2), Plan(adam_thread="compute"), measured)
    assert est.optimizer_exposed_seconds == pytest.approx(m.numel_total * adam_time.ADAM_SHADOW_FACTOR / 1e9)
    # AdamW with bf16 state: its pass in place of fp32 AdamW, measured on one thread (0.2e9/s), on every core
    # there: x 1e9 / 0.6e9.
    bf16 = measured.replace(cpu_bf16_state_params_per_s=0.2e9)
    work = Workload(256, 2, compute_dtype="fp32", optimizer_state="bf16")
    for thread, per_param in (("worker", 1 / 0.2e9), ("compute", 1 / (0.2e9 * 1e9 / 0.6e9))):
        est = cost_model.estimate(m, work, Plan(adam_thread=thread), bf16)
        assert est.optimizer_exposed_seconds == pytest.approx(m.numel_total * per_param), thread


def test_computing_in_place_saves_exactly_the_copies() -> None:
    """A CPU device computing in place (``Plan.compute_in_place``) copies no weights or gradients: its step is the
    same plan's with copies less every copy, by hand (device checkpoints, untied head, fp32):
    H2D = (E + L x layer + head) x 4 forward + L x layer x 4 backward, in 2L + 2 copies;
    D2H = (L x layer + E + head) x 4, in L + 2 copies; each copy bytes / (GB/s x 1e9) + COPY_LATENCY_S."""
    cpu = hardware.HardwareProfile(gpu_name="cpu", gpu_mem_bytes=0, h2d_gbps=10, d2h_gbps=4, duplex_gbps=10,
                                   matmul_tflops={"float32": 0.1, "bfloat16": 0.1}, cpu_adam_params_per_s=1e9,
                                   host_ram_bytes=64 << 30, host_available_bytes=60 << 30, cores=2)
    m = dataclasses.replace(PRESETS["shape:Qwen2.5-0.5B"], tie_word_embeddings=False)
    work, plan = Workload(256, 2, compute_dtype="fp32"), Plan(adam_thread="compute", micro_batch_size=2)
    copies, in_place = (cost_model.estimate(m, work, p, cpu) for p in (plan, plan.replace(compute_in_place=True)))
    L, E, Lw, H = m.num_layers, m.numel_embedding, m.numel_layer, m.numel_head
    h2d = ((E + L * Lw + H) + L * Lw) * 4 / 10e9 + (2 * L + 2) * cost_model.COPY_LATENCY_S
    d2h = (L * Lw + E + H) * 4 / 4e9 + (L + 2) * cost_model.COPY_LATENCY_S
    assert copies.step_seconds - in_place.step_seconds == pytest.approx(h2d + d2h)
    assert (in_place.h2d_bytes, in_place.d2h_bytes) == (0.0, 0.0) and copies.h2d_bytes > 0
    assert in_place.optimizer_exposed_seconds == copies.optimizer_exposed_seconds == pytest.approx(m.numel_total / 1e9)


def test_adamw_time_counts_the_shadow_pass_only_where_there_is_one() -> None:
    """fp32 compute sends the master itself: AdamW alone. bf16: AdamW plus the measured fp32 -> bf16
    rounding pass, or AdamW x ADAM_SHADOW_FACTOR when the profile has no shadow rate."""
    n = M8.numel_total
    plan = Plan(micro_batch_size=2)

    def adam(work: Workload, **kw: object) -> float:
        est = cost_model.estimate(M8, work, plan, _hw(cpu_adam_params_per_s=1e9, **kw))
        return est.forward.adam_s + est.backward.adam_s

    fp32, bf16 = Workload(1024, 4, compute_dtype="fp32"), Workload(1024, 4, compute_dtype="bf16")
    assert adam(fp32) == pytest.approx(n / 1e9)
    assert adam(fp32, cpu_shadow_params_per_s=2e9) == pytest.approx(n / 1e9)
    assert adam(bf16) == pytest.approx(n / 1e9 * adam_time.ADAM_SHADOW_FACTOR)
    assert adam(bf16, cpu_shadow_params_per_s=2e9) == pytest.approx(n / 1e9 + n / 2e9)


def test_bf16_state_update_takes_the_place_of_fp32_adamw() -> None:
    """bf16 m and v: their one pass (widen, update, round back) instead of fp32 AdamW, at the profile's measured
    rate, or BF16_STATE_FACTOR x the AdamW time where it has none; fp32 state ignores that rate. With bf16 compute
    the shadow pass comes on top either way."""
    n = M8.numel_total
    plan = Plan(micro_batch_size=2)

    def adam(state: str, compute: str = "fp32", **kw: object) -> float:
        est = cost_model.estimate(M8, Workload(1024, 4, compute_dtype=compute, optimizer_state=state), plan,
                                  _hw(cpu_adam_params_per_s=1e9, **kw))
        return est.forward.adam_s + est.backward.adam_s

    assert adam("fp32", cpu_bf16_state_params_per_s=0.2e9) == pytest.approx(n / 1e9)
    assert adam("bf16") == pytest.approx(n / 1e9 * adam_time.BF16_STATE_FACTOR)
    assert adam("bf16", cpu_bf16_state_params_per_s=0.2e9) == pytest.approx(n / 0.2e9)
    assert adam("bf16", cpu_bf16_state_params_per_s=2e9) == pytest.approx(n / 2e9)
    assert adam("bf16", "bf16", cpu_bf16_state_params_per_s=2e9, cpu_shadow_params_per_s=4e9) == pytest.approx(
        n / 2e9 + n / 4e9)


def test_the_bf16_state_probe_times_the_pass_and_leaves_the_thread_count() -> None:
    import torch

    from megatrain.planner.profiling.host_rates import cpu_bf16_state_rate

    before = torch.get_num_threads()
    assert cpu_bf16_state_rate(1 << 14, threads=1) > 0
    assert torch.get_num_threads() == before


def test_the_bf16_state_figure_is_fp32_adamws_rate_times_the_ratio_measured_side_by_side(monkeypatch) -> None:
    """The probe's child process times both updates alternated; the profile's figure is its own fp32 AdamW rate x
    their ratio (bf16 / fp32), or the child's bf16 rate where none is given; 0 where the child fails."""
    import subprocess

    from megatrain.planner.profiling import host_rates

    def child(out: str, rc: int = 0):
        return lambda cmd, **kw: subprocess.CompletedProcess(cmd, rc, stdout=out, stderr="")

    monkeypatch.setattr(host_rates.subprocess, "run", child('{"params_per_s": 2e8, "fp32_params_per_s": 4e8}\n'))
    assert host_rates.cpu_bf16_state_rate(1 << 22, 1, fp32_rate=1e9) == pytest.approx(5e8)
    assert host_rates.cpu_bf16_state_rate(1 << 22, 1) == pytest.approx(2e8)
    monkeypatch.setattr(host_rates.subprocess, "run", child("Traceback ...", rc=1))
    assert host_rates.cpu_bf16_state_rate(1 << 22, 1, fp32_rate=1e9) == 0.0


@pytest.mark.parametrize("field", ["cpu_shadow_params_per_s", "cpu_bf16_state_params_per_s"])
def test_a_negative_cpu_pass_rate_is_refused(field) -> None:
    with pytest.raises(hardware.HardwareError, match=field):
        _hw(**{field: -1.0})


def test_disk_terms_of_a_spilled_step_by_hand() -> None:
    """spill="all" in fp32 on a CPU: AdamW reads and writes 4 kinds (4 x F each way); with deferred updates each
    block's forward load takes the master its update writes (the runtime's tap), so the loads read the backward's
    L layers and the tied embedding again; with eager ones every load reads the fp32 master from its file
    (embedding, 2 x L layers, head, tied embedding again) but what a backward load copies from the staging sets. The step is at least the disk's time, read bytes /
    read GB/s + written bytes / write GB/s."""
    cpu = hardware.HardwareProfile(gpu_name="cpu", gpu_mem_bytes=0, h2d_gbps=10, d2h_gbps=10, duplex_gbps=10,
                                   matmul_tflops={"float32": 100.0, "bfloat16": 100.0}, cpu_adam_params_per_s=1e12,
                                   host_ram_bytes=64 << 30, host_available_bytes=60 << 30, cores=2,
                                   disk_read_gbps=2.0, disk_write_gbps=1.0)
    m = PRESETS["shape:Llama-3.2-1B"]
    plan = Plan(spill="all", spill_dir="/tmp")
    est = cost_model.estimate(m, Workload(128, 1, compute_dtype="fp32"), plan, cpu)
    F = m.spill_file_bytes
    loads = (m.num_layers * m.numel_layer + m.numel_embedding) * 4
    assert est.disk_read_bytes == 4 * F + loads and est.disk_write_bytes == 4 * F
    assert est.disk_seconds == pytest.approx((4 * F + loads) / 2e9 + 4 * F / 1e9)
    assert est.step_seconds >= est.disk_seconds
    eager = cost_model.estimate(m, Workload(128, 1, compute_dtype="fp32", clipping=False),
                                plan.replace(optimizer_mode="eager"), cpu)
    loads = (m.numel_embedding + 2 * m.num_layers * m.numel_layer + m.numel_head + m.numel_embedding) * 4
    # (eager mode has no full gradient buffer to spill: master, m and v); each backward load of a layer copies the
    # master of the first chunks of its update the read-ahead staged, what the plan's sets hold (3 sets of 64 MiB
    # per kind: 3 x 64 MiB of a 232 MiB layer): [Note: lent masters]
    lent = m.num_layers * plan.spill_staging * plan.spill_chunk_bytes
    assert m.numel_layer * 4 > plan.spill_staging * plan.spill_chunk_bytes
    assert eager.disk_read_bytes == 3 * F + loads - lent and eager.disk_write_bytes == 3 * F
    assert eager.step_seconds >= eager.disk_seconds == pytest.approx((3 * F + loads - lent) / 2e9 + 3 * F / 1e9)
    none = cost_model.estimate(m, Workload(128, 1, compute_dtype="fp32"), Plan(), cpu)
    assert none.disk_read_bytes == none.disk_write_bytes == none.disk_seconds == 0


def test_a_load_the_read_ahead_lends_its_master_reads_nothing_from_disk() -> None:
    """[Note: lent masters]: a load copies the master chunks the read-ahead staged for its block's update instead
    of reading them. With a disk so fast that the read-ahead always runs ahead and a set for every chunk, every
    load is lent but the ones before any read-ahead, so the step reads the updates' kinds and the embedding's
    master once: eager, 3 x F (master, m, v) and the embedding's first load (it precedes any read-ahead);
    deferred, 4 x F (the gradients too) and a tied head's re-load of the embedding (the forward's other loads
    take the update's writes, backward's are all lent). Fewer sets lend less; the disk floor counts what is read."""
    fast = hardware.HardwareProfile(gpu_name="cpu", gpu_mem_bytes=0, h2d_gbps=10, d2h_gbps=10, duplex_gbps=10,
                                    matmul_tflops={"float32": 1.0, "bfloat16": 1.0}, cpu_adam_params_per_s=1e9,
                                    host_ram_bytes=64 << 30, host_available_bytes=60 << 30, cores=2,
                                    disk_read_gbps=1e6, disk_write_gbps=1e6)
    m = PRESETS["shape:Llama-3.2-1B"]
    assert m.tie_word_embeddings
    F, table = m.spill_file_bytes, m.numel_embedding * 4
    every = Plan(spill="all", spill_dir="/tmp", spill_staging=10**6)
    eager_work = Workload(128, 1, compute_dtype="fp32", clipping=False)
    eager = cost_model.estimate(m, eager_work, every.replace(optimizer_mode="eager"), fast)
    assert eager.disk_read_bytes == pytest.approx(3 * F + table) and eager.disk_write_bytes == 3 * F
    assert eager.disk_seconds == pytest.approx((3 * F + table) / 1e15 + 3 * F / 1e15)
    deferred = cost_model.estimate(m, Workload(128, 1, compute_dtype="fp32"), every, fast)
    assert deferred.disk_read_bytes == pytest.approx(4 * F + table) and deferred.disk_write_bytes == 4 * F
    one = cost_model.estimate(m, eager_work, every.replace(optimizer_mode="eager", spill_staging=1), fast)
    assert one.disk_read_bytes > eager.disk_read_bytes + m.num_layers * m.numel_layer * 4 / 2
