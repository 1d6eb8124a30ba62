"""Hardware presets: GPUs and hosts by name, with datasheet-derived (or measured) figures and their sources, from
which ``hardware.preset`` builds a HardwareProfile. Pure stdlib.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

__all__ = ["MiB", "GiB", "HostPreset", "GpuPreset", "HOST_PRESETS", "GPU_PRESETS"]

MiB = 1024 ** 2
GiB = 1024 ** 3


@dataclass(frozen=True)
class HostPreset:
    """A host: RAM, cores, CPU AdamW rate, NVMe. CPU AdamW is memory-bound at ~28-30 bytes moved
    per parameter (anchors.md), so params/s ~= achievable memory bandwidth / 30 bytes."""

    name: str
    ram_bytes: int
    cores: int
    cpu_adam_params_per_s: float
    disk_read_gbps: float
    disk_write_gbps: float
    source: str


@dataclass(frozen=True)
class GpuPreset:
    """A GPU and the link to its host. Memory is the total nvidia-smi reports for the board; TFLOP/s are
    dense and 'achievable': measured where anchors.md has a measurement, else 0.8 x the datasheet."""

    name: str
    mem_bytes: int
    matmul_tflops: Mapping[str, float]
    h2d_gbps: float
    d2h_gbps: float
    duplex_gbps: float
    interconnect: str
    default_host: str
    source: str = field(default="")


HOST_PRESETS: dict[str, HostPreset] = {h.name: h for h in (
    HostPreset("workstation-128g", 128 * GiB, 16, 2.0e9, 7.0, 5.0,
               "estimate: 2-channel DDR5 ~60 GB/s / 30 B per param; PCIe Gen4 NVMe 7/5 GB/s datasheet"),
    HostPreset("workstation-256g", 256 * GiB, 32, 3.5e9, 7.0, 5.0,
               "estimate: 4-channel DDR5 ~105 GB/s / 30 B per param; PCIe Gen4 NVMe 7/5 GB/s datasheet"),
    HostPreset("server-512g", 512 * GiB, 64, 6.0e9, 12.0, 10.0,
               "estimate: 8-channel DDR5 ~180 GB/s / 30 B per param; PCIe Gen5 NVMe 12/10 GB/s datasheet"),
    HostPreset("server-1t", 1024 * GiB, 96, 8.0e9, 12.0, 10.0,
               "estimate: 12-channel DDR5 ~240 GB/s / 30 B per param; PCIe Gen5 NVMe 12/10 GB/s datasheet"),
    HostPreset("server-2t", 2048 * GiB, 112, 10.0e9, 12.0, 10.0,
               "estimate: dual-socket DDR5 (DGX H100 class, 2 TB) ~300 GB/s / 30 B per param"),
    HostPreset("grace-480g", 480 * GiB, 72, 12.0e9, 12.0, 10.0,
               "estimate: Grace LPDDR5X ~500 GB/s spec, ~360 achievable / 30 B per param (GH200 datasheet)"),
)}

_PCIE5 = "PCIe Gen5 x16: ~64 GB/s per direction spec, ~50-55 pinned in practice (anchors.md)"
_PCIE4 = "PCIe Gen4 x16: ~32 GB/s per direction spec, ~25 pinned in practice"

GPU_PRESETS: dict[str, GpuPreset] = {g.name: g for g in (
    GpuPreset("H100-SXM", 81559 * MiB, {"bfloat16": 790.0, "float16": 790.0, "tf32": 396.0, "float32": 54.0},
              52.0, 52.0, 90.0, "PCIe Gen5 x16", "server-2t",
              "NVIDIA H100 datasheet (SXM5 80GB: 989 bf16 / 495 tf32 / 67 fp32 dense TFLOPS); bf16 790 measured "
              "on lent machines (anchors.md), others 0.8 x spec; " + _PCIE5),
    GpuPreset("H100-PCIe", 81559 * MiB, {"bfloat16": 605.0, "float16": 605.0, "tf32": 302.0, "float32": 41.0},
              52.0, 52.0, 90.0, "PCIe Gen5 x16", "server-1t",
              "NVIDIA H100 datasheet (PCIe 80GB: 756 bf16 / 378 tf32 / 51 fp32 dense TFLOPS) x 0.8; " + _PCIE5),
    GpuPreset("H200", 143771 * MiB, {"bfloat16": 790.0, "float16": 790.0, "tf32": 396.0, "float32": 54.0},
              52.0, 52.0, 90.0, "PCIe Gen5 x16", "server-2t",
              "NVIDIA H200 datasheet (141 GB HBM3e, compute as H100 SXM); bf16 790 measured (anchors.md); "
              + _PCIE5),
    GpuPreset("GH200", 97871 * MiB, {"bfloat16": 790.0, "float16": 790.0, "tf32": 396.0, "float32": 54.0},
              360.0, 360.0, 600.0, "NVLink-C2C", "grace-480g",
              "NVIDIA GH200 datasheet (96 GB HBM3; NVLink-C2C 450 GB/s per direction spec, 0.8 assumed "
              "achievable); compute as H100 SXM"),
    GpuPreset("A100-40GB", 40960 * MiB, {"bfloat16": 250.0, "float16": 250.0, "tf32": 125.0, "float32": 15.6},
              25.0, 25.0, 40.0, "PCIe Gen4 x16", "server-1t",
              "NVIDIA A100 datasheet (312 bf16 / 156 tf32 / 19.5 fp32 dense TFLOPS) x 0.8; " + _PCIE4),
    GpuPreset("A100-80GB", 81920 * MiB, {"bfloat16": 250.0, "float16": 250.0, "tf32": 125.0, "float32": 15.6},
              25.0, 25.0, 40.0, "PCIe Gen4 x16", "server-1t",
              "NVIDIA A100 datasheet (312 bf16 / 156 tf32 / 19.5 fp32 dense TFLOPS) x 0.8; " + _PCIE4),
    GpuPreset("L40S", 46068 * MiB, {"bfloat16": 290.0, "float16": 290.0, "tf32": 146.0, "float32": 73.0},
              25.0, 25.0, 40.0, "PCIe Gen4 x16", "server-512g",
              "NVIDIA L40S datasheet (362 bf16 / 183 tf32 / 91.6 fp32 dense TFLOPS) x 0.8; " + _PCIE4),
    GpuPreset("RTX-4090", 24564 * MiB, {"bfloat16": 132.0, "float16": 132.0, "tf32": 66.0, "float32": 66.0},
              25.0, 25.0, 40.0, "PCIe Gen4 x16", "workstation-128g",
              "NVIDIA Ada whitepaper (RTX 4090: 165 bf16 fp32-accumulate / 82.6 tf32 / 82.6 fp32 dense TFLOPS) "
              "x 0.8; " + _PCIE4),
    GpuPreset("RTX-3090", 24576 * MiB, {"bfloat16": 57.0, "float16": 57.0, "tf32": 28.5, "float32": 28.5},
              25.0, 25.0, 40.0, "PCIe Gen4 x16", "workstation-128g",
              "NVIDIA Ampere GA102 whitepaper (RTX 3090: 71 bf16 fp32-accumulate / 35.6 tf32 / 35.6 fp32 "
              "dense TFLOPS) x 0.8; " + _PCIE4),
)}
