"""Hardware profiles: presets, JSON round trip, overrides, errors; the profiler on this (CPU) machine."""
from __future__ import annotations

import json

import pytest

from megatrain.planner.profiling import hardware, host_probe, profiler
from megatrain.planner.profiling.hardware import GiB, HardwareError, HardwareProfile

GPUS = ("H100-SXM", "H100-PCIe", "H200", "GH200", "A100-40GB", "A100-80GB", "L40S", "RTX-4090", "RTX-3090")


def test_every_preset_builds_with_a_source() -> None:
    assert set(GPUS) == set(hardware.GPU_PRESETS)
    for name in GPUS:
        hw = hardware.preset(name)
        assert hw.gpu_mem_bytes > 20 * GiB and hw.source.startswith(f"preset {name}")
        assert hw.tflops("bf16") > hw.tflops("float32") > 0
    for host in hardware.HOST_PRESETS:
        hw = hardware.preset("H100-SXM", host)
        assert host in hw.source and hw.host_budget_bytes < hw.host_ram_bytes


def test_json_round_trip(tmp_path) -> None:
    hw = hardware.preset("GH200").replace(transfer_by_size=((1 << 20, 10.0, 9.0, 15.0),),
                                         adam_by_threads=((1, 1e9), (2, 1.8e9)))
    assert HardwareProfile.from_json(hw.to_json()) == hw
    path = tmp_path / "hw.json"
    hw.save(str(path))
    assert hardware.resolve(str(path)) == hw


def test_overrides_replace_single_figures() -> None:
    hw = hardware.preset("RTX-4090").with_overrides(ram_bytes=512 * GiB, gpu_mem_bytes=48 * GiB, nvme_gbps=3.5)
    assert hw.host_ram_bytes == hw.host_available_bytes == 512 * GiB
    assert hw.host_budget_bytes == int(512 * GiB * (1 - hardware.HOST_HEADROOM))
    assert hw.gpu_mem_bytes == 48 * GiB and hw.disk_read_gbps == hw.disk_write_gbps == 3.5
    assert "overridden" in hw.source
    assert hw.h2d_gbps == hardware.preset("RTX-4090").h2d_gbps


def test_cgroup_limit_caps_the_host_budget_and_a_plan_leaves_headroom_below_it() -> None:
    hw = hardware.preset("H100-SXM").replace(cgroup_limit_bytes=64 * GiB)
    assert hw.host_budget_bytes == int(64 * GiB * 0.95)


def test_a_plan_within_the_headroom_of_the_available_ram_does_not_fit() -> None:
    """Peak RSS ran 3-6.5% above the memory model on large spilled runs: a plan filling 97% of what is available
    is refused, one at 94% fits."""
    from megatrain.planner.costs.memory_model import Component, MemoryEstimate

    hw = hardware.preset("H100-SXM").replace(host_available_bytes=100 * GiB, cgroup_limit_bytes=0)
    for share, fits in ((0.97, False), (0.94, True)):
        est = MemoryEstimate((Component("fp32 master", "host", int(share * 100 * GiB), "x"),))
        assert (est.overruns(hw) == []) == fits


def test_errors_name_field_and_fix(tmp_path) -> None:
    with pytest.raises(HardwareError, match="valid: H100-SXM"):
        hardware.resolve("B200")
    with pytest.raises(HardwareError, match="valid: workstation-128g"):
        hardware.preset("H100-SXM", "tiny-host")
    with pytest.raises(HardwareError, match="h2d_gbps"):
        hardware.preset("H100-SXM").replace(h2d_gbps=0)
    with pytest.raises(HardwareError, match="host_available_bytes"):
        hardware.preset("H100-SXM").replace(host_available_bytes=1 << 50)
    data = json.loads(hardware.preset("L40S").to_json())
    data["warp_drive"] = 1
    with pytest.raises(HardwareError, match="unknown hardware field"):
        HardwareProfile.from_dict(data)
    del data["warp_drive"], data["h2d_gbps"]
    with pytest.raises(HardwareError, match="lacks h2d_gbps"):
        HardwareProfile.from_dict(data)
    bad = tmp_path / "bad.json"
    bad.write_text("[1,")
    with pytest.raises(HardwareError, match="not valid JSON"):
        hardware.resolve(str(bad))


def test_a_profile_saved_with_a_retired_field_still_loads(tmp_path) -> None:
    """memlock_bytes, which earlier releases wrote and nothing read, is dropped on load; the figures are kept."""
    hw = hardware.preset("L40S")
    data = json.loads(hw.to_json())
    assert "memlock_bytes" not in data
    old = tmp_path / "hardware.json"
    old.write_text(json.dumps(dict(data, memlock_bytes=65536)))
    assert HardwareProfile.load(str(old)) == hw


def test_host_figures() -> None:
    total, avail, cg = host_probe.host_memory()
    assert 0 < avail <= total and cg >= 0


def test_detect_without_benchmarks() -> None:
    hw = profiler.detect()
    assert hw.host_ram_bytes > 0
    if not host_probe.gpu_present():
        assert hw.device_is_host and "no GPU" in hw.source


def test_matching_preset_names() -> None:
    assert profiler._matching_preset("NVIDIA H100 80GB HBM3") == "H100-SXM"
    assert profiler._matching_preset("NVIDIA H100 PCIe") == "H100-PCIe"
    assert profiler._matching_preset("NVIDIA GH200 480GB") == "GH200"
    assert profiler._matching_preset("NVIDIA A100-SXM4-80GB") == "A100-80GB"
    assert profiler._matching_preset("NVIDIA GeForce RTX 3090") == "RTX-3090"
    assert profiler._matching_preset("Tesla T4") is None


def test_measure_on_this_machine(tmp_path, monkeypatch) -> None:
    """Every figure measured, and the disk's as ``measure_disk`` gives them for the folder named (the probe itself
    runs in ``test_planner_cli``'s ``--disk-only`` test)."""
    pytest.importorskip("torch")
    disk = dict(disk_read_gbps=1.5, disk_write_gbps=2.5, disk_direct_faster=True, disk_cpu_s_per_gb=0.1)
    asked = []
    monkeypatch.setattr(profiler, "measure_disk", lambda folder, beside, log: asked.append(folder) or disk)
    hw = profiler.measure(str(tmp_path))
    assert asked == [str(tmp_path)] and "disk not measured" not in hw.source
    assert (hw.disk_read_gbps, hw.disk_write_gbps, hw.disk_direct_faster, hw.disk_cpu_s_per_gb) == (1.5, 2.5, True, 0.1)
    assert hw.cpu_adam_params_per_s > 0 and hw.adam_by_threads and hw.cpu_shadow_params_per_s > 0
    assert hw.cpu_bf16_state_params_per_s > 0  # the runtime's bf16-state pass, timed in its own process
    # AdamW's memory traffic: 28 bytes/param x the best params/s, beside the triad's GB/s
    assert hw.cpu_adam_bytes_per_param == 28 and hw.host_memory_gbps > 0
    assert hw.cpu_adam_gbps == pytest.approx(28 * hw.cpu_adam_params_per_s / 1e9)
    assert (hw.device_adam_gbps == 0) == hw.device_is_host  # the GPU's fused AdamW, where there is a GPU
    assert all(v > 0 for v in hw.matmul_tflops.values())
    seqs = profiler.ATTENTION_SEQS_CPU if hw.device_is_host else profiler.ATTENTION_SEQS_GPU
    assert [n for n, _ in hw.attention_tflops["float32"]] == list(seqs)
    assert all(r > 0 for pts in hw.attention_tflops.values() for _, r in pts)
    assert HardwareProfile.from_json(hw.to_json()) == hw
    if hw.device_is_host:
        assert "no GPU" in hw.source


def test_attention_rate_counts_the_planners_flops(monkeypatch) -> None:
    """The measured rate is the planner's FLOPs for the call over its seconds: with the clock stubbed to
    advance 0.5 s per reading pair, rate = seq x a_fwd x 3.5 / 0.5 s."""
    pytest.importorskip("torch")
    from megatrain.planner.shapes.model_shapes import attention_flops_per_token

    ticks = iter(range(1000))
    monkeypatch.setattr(profiler.time, "perf_counter", lambda: next(ticks) * 0.5)
    got = profiler.attention_tflops("cpu", ("float32",), (64, 128), 2, 16)
    assert [n for n, _ in got["float32"]] == [64, 128]
    for n, r in got["float32"]:
        assert r == pytest.approx(n * attention_flops_per_token(2, 16, n) * 3.5 / 0.5 / 1e12)


@pytest.mark.gpu
def test_measure_gpu_transfers() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    table = profiler.gpu_transfers((1 << 20, 1 << 26))
    assert all(h2d > 0 and d2h > 0 and both > 0 for _, h2d, d2h, both in table)


@pytest.mark.parametrize("cores, host", [(16, "workstation-128g"), (32, "workstation-256g"), (112, "server-2t")])
def test_detect_takes_the_host_rates_of_this_machines_size(monkeypatch, cores, host) -> None:
    # An H200 on a 16-core host ran CPU AdamW at 2.2-2.6 Gparam/s, where its preset's usual host (server-2t,
    # 112 cores) says 10: a detected GPU's host rates come from the host preset of the machine's core count.
    import types

    import torch

    monkeypatch.setattr(profiler, "gpu_present", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(name="NVIDIA H200", total_memory=150 * GiB))
    monkeypatch.setattr(profiler.os, "cpu_count", lambda: cores)
    hw = profiler.detect()
    assert hw.gpu_mem_bytes == 150 * GiB and hw.matmul_tflops == hardware.preset("H200").matmul_tflops
    assert hw.cpu_adam_params_per_s == hardware.HOST_PRESETS[host].cpu_adam_params_per_s
    assert hw.disk_read_gbps == hardware.HOST_PRESETS[host].disk_read_gbps and hw.cores == cores
    assert f"+ {host}" in hw.source


def test_the_disks_cpu_time_is_a_number_at_least_zero() -> None:
    hw = hardware.preset("H100-SXM")
    assert hw.disk_cpu_s_per_gb == 0.0                     # presets: not measured, no term
    assert HardwareProfile.from_json(hw.replace(disk_cpu_s_per_gb=0.09).to_json()).disk_cpu_s_per_gb == 0.09
    with pytest.raises(HardwareError, match="disk_cpu_s_per_gb"):
        hw.replace(disk_cpu_s_per_gb=-0.1)


def test_adams_bytes_per_parameter_by_hand() -> None:
    from megatrain.planner.profiling.host_rates import adam_bytes_per_param

    # master read + write (4 + 4), gradient read (4), m and v read + written (2 x 2 x state bytes)
    assert adam_bytes_per_param(4) == 4 + 4 + 4 + 2 * 2 * 4 == 28
    assert adam_bytes_per_param(2) == 4 + 4 + 4 + 2 * 2 * 2 == 20


def test_a_profile_without_the_memory_figures_loads_and_says_so(tmp_path) -> None:
    """Profiles written before AdamW's GB/s and the host's bandwidth were measured load with them unknown (0); the
    profile text says "not measured" for them, and gives them where measured."""
    from megatrain.planner.commands import report

    data = json.loads(hardware.preset("H200").replace(cpu_bf16_state_params_per_s=2e9).to_json())
    for f in ("host_memory_gbps", "cpu_adam_bytes_per_param", "cpu_adam_gbps"):
        del data[f]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = HardwareProfile.load(str(path))
    assert (old.host_memory_gbps, old.cpu_adam_bytes_per_param, old.cpu_adam_gbps) == (0.0, 0, 0.0)
    line = report.adam_memory_line(old)
    assert "not measured" in line and f"{2e9 / old.cpu_adam_params_per_s:.2f}x fp32 AdamW" in line
    new = old.replace(host_memory_gbps=200.0, cpu_adam_bytes_per_param=28, cpu_adam_gbps=150.0)
    assert "150.0 GB/s of the host's 200.0 GB/s memory bandwidth (triad), 75%" in report.adam_memory_line(new)
    with pytest.raises(HardwareError, match="host_memory_gbps"):
        old.replace(host_memory_gbps=-1.0)


def test_a_profile_without_the_device_adamw_rate_loads_with_the_assumed_one(tmp_path) -> None:
    """Profiles written before the GPU's fused AdamW was measured load with it unknown (0): the cost model then
    times a resident block's update at resident_blocks.DEVICE_ADAM_GBPS, and the profile text says so; a measured
    figure is the one used and printed; a CPU-only profile has none."""
    from megatrain.planner.commands import report
    from megatrain.planner.costs import resident_blocks

    data = json.loads(hardware.preset("H100-SXM").to_json())
    del data["device_adam_gbps"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = HardwareProfile.load(str(path))
    assert old.device_adam_gbps == 0.0 and resident_blocks.device_adam_gbps(old) == resident_blocks.DEVICE_ADAM_GBPS
    assert f"not measured (the planner assumes {resident_blocks.DEVICE_ADAM_GBPS:.0f} GB/s)" in \
        report.device_adam_line(old)
    new = old.replace(device_adam_gbps=2800.0)
    assert resident_blocks.device_adam_gbps(new) == 2800.0
    assert "2800 GB/s at 28 B/param, 100.0 Gparam/s" in report.device_adam_line(new)
    assert HardwareProfile.from_json(new.to_json()) == new
    assert "none (no GPU" in report.device_adam_line(new.replace(gpu_mem_bytes=0))
    with pytest.raises(HardwareError, match="device_adam_gbps"):
        old.replace(device_adam_gbps=-1.0)


@pytest.mark.gpu
def test_the_device_adamw_rate_on_cuda() -> None:
    """On a GPU the profile's fused AdamW figure is 28 bytes a parameter x params/s over device buffers: within what
    device memory can move (a unit slip, bytes for GB or MB, lands outside)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gbps = profiler.device_adam_gbps(1 << 24)
    assert 100.0 < gbps < 10_000.0, gbps  # an H100's HBM3 3350 GB/s, an H200's 4800; a PCIe card's GDDR ~1000
