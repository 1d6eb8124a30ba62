"""Hardware profile: the measured (or preset) figures the planner plans against.

A HardwareProfile is data: bandwidths, matmul rates, CPU AdamW rate, memory budgets. ``megatrain-plan profile``
measures one (planner/profiler.py); presets (hardware_presets.py) carry datasheet-derived estimates with their
sources. Pure stdlib.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from megatrain.errors import MegatrainError

from megatrain.planner.profiling.calibration import Calibration, CalibrationError, log2_interpolate
from megatrain.planner.profiling.hardware_presets import (GPU_PRESETS, HOST_PRESETS, GiB,
                                                          MiB)  # MiB, GiB: re-exported to the planner

GB = 1e9
PROFILE_VERSION = 1
# Share of the available host RAM a plan leaves unfilled, for what the memory model does not see: spilled runs of
# 1-5B parameters on a CPU peaked 3-6.5% (0.6-0.8 GiB) above it, and a run killed for memory loses its work.
HOST_HEADROOM = 0.05
# Device memory traffic of one fused AdamW update of an fp32 parameter on the device (a resident block's: master,
# gradient, m, v read, 16; master, m, v written, 12): what ``device_adam_gbps`` counts per parameter.
DEVICE_ADAM_BYTES_PER_PARAM = 28
# Fields earlier releases wrote and nothing read (RLIMIT_MEMLOCK: CUDA pins through the driver); dropped on load.
RETIRED_FIELDS = frozenset({"memlock_bytes"})


class HardwareError(MegatrainError):
    """A hardware name, file or figure cannot be used. One line: what, and the fix."""


@dataclass(frozen=True)
class HardwareProfile:
    """One machine: a GPU (or none: gpu_mem_bytes == 0 means the device is the CPU) and its host.

    Bandwidths are GB/s (1e9 bytes per second), measured pinned; rates are per second.
    """

    gpu_name: str
    gpu_mem_bytes: int
    # Pinned host -> device, device -> host, and the total of both directions when run at once.
    h2d_gbps: float
    d2h_gbps: float
    duplex_gbps: float
    # Dense matmul TFLOP/s per compute dtype ("bfloat16", "float16", "tf32", "float32").
    matmul_tflops: Mapping[str, float]
    # CPU AdamW (torch fused, one flat fp32 buffer) parameters per second with all cores.
    cpu_adam_params_per_s: float
    host_ram_bytes: int
    host_available_bytes: int
    cores: int
    cgroup_limit_bytes: int = 0  # the cgroup's memory limit (0 = none)
    disk_read_gbps: float = 0.0
    disk_write_gbps: float = 0.0
    # Whether plans move spill data with O_DIRECT on that disk (the plan's io_direct follows it): True where the
    # profile's disk pass ran with O_DIRECT, False where the filesystem refused it (the figures are buffered ones)
    # or a user set it. None: not measured (O_DIRECT where the filesystem takes it).
    disk_direct_faster: bool | None = None
    # CPU seconds the cores lose per GB the disk moves (O_DIRECT reads and writes beside a matmul, against it
    # alone): the kernel's share of spill I/O, taken from compute where the device is the CPU. 0: not measured.
    disk_cpu_s_per_gb: float = 0.0
    # "PCIe Gen5 x16", "NVLink-C2C", "none": a label; the measured bandwidth is what counts.
    interconnect: str = "unknown"
    # Where the figures come from (a measurement with its date, or a datasheet).
    source: str = "unspecified"
    # Optional measurements by transfer size: (bytes, h2d GB/s, d2h GB/s, duplex GB/s).
    transfer_by_size: tuple[tuple[int, float, float, float], ...] = ()
    # Optional CPU AdamW params/s by thread count: (threads, params/s).
    adam_by_threads: tuple[tuple[int, float], ...] = ()
    # CPU rounding of fp32 masters into the bf16 shadow (params/s, all cores), the pass after AdamW
    # when compute is not fp32; 0: not measured (the cost model then assumes ADAM_SHADOW_FACTOR).
    cpu_shadow_params_per_s: float = 0.0
    # CPU AdamW with bf16 m and v (params/s, on the AdamW worker's threads): the one pass that widens them,
    # updates the fp32 master and rounds them back, in place of fp32 state's AdamW (measured as its ratio to fp32
    # AdamW, the two alternated in one process, by CPU time on one thread, x fp32 AdamW's rate on those threads);
    # 0: not measured (the cost model then assumes BF16_STATE_FACTOR x the AdamW time). Profiles measured before
    # that pass was fused hold the widening and rounding alone, a lower rate than the fused update's: plans made
    # with them overestimate it.
    cpu_bf16_state_params_per_s: float = 0.0
    # The host's memory bandwidth: a triad (a = b + s x c over fp32 arrays far beyond the caches, 12 bytes per
    # element) in GB/s, on the thread count of cpu_adam_params_per_s; 0: not measured (older profiles).
    host_memory_gbps: float = 0.0
    # Bytes CPU AdamW moves per parameter with fp32 state (host_rates.adam_bytes_per_param: 28), and the GB/s it
    # reaches at cpu_adam_params_per_s (bytes/param x params/s), to compare with host_memory_gbps; 0: not measured.
    cpu_adam_bytes_per_param: int = 0
    cpu_adam_gbps: float = 0.0
    # torch's fused AdamW on the GPU over fp32 device buffers (the resident blocks' update), GB/s at
    # DEVICE_ADAM_BYTES_PER_PARAM bytes a parameter; 0: not measured (no GPU, a preset, an older profile: the cost
    # model then assumes resident_blocks.DEVICE_ADAM_GBPS).
    device_adam_gbps: float = 0.0
    # Causal attention (scaled_dot_product_attention with is_causal, forward + backward) TFLOP/s per compute
    # dtype by sequence length, FLOPs counted as the planner counts them (model_flops.attention_flops_per_token):
    # {"float32": ((seq, TFLOP/s), ...)}. Empty for a dtype: not measured (attention runs at the layers' rate).
    attention_tflops: Mapping[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    # A dense decoder layer's forward, recompute and backward eager over the same through torch.compile (the
    # runtime's Plan.compiled_layers), per compute dtype, at one representative shape (``megatrain-plan profile
    # --compiled-layers`` on a GPU: compiled_speedup.py): {"bfloat16": 1.15}. Empty for a dtype: not measured (older
    # profiles, a CPU), and the search never offers compiled layers there.
    compiled_layer_speedup: Mapping[str, float] = field(default_factory=dict)
    # Cost and memory constants fitted from real training steps on this machine (megatrain-plan calibrate),
    # one per compute dtype, with their source; for a dtype without one the models use their defaults.
    calibrations: tuple[Calibration, ...] = ()
    version: int = PROFILE_VERSION

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise HardwareError(f"hardware profile version={self.version} is not supported (this release reads "
                                f"{PROFILE_VERSION}); run megatrain-plan profile again")
        object.__setattr__(self, "matmul_tflops", dict(self.matmul_tflops))
        object.__setattr__(self, "transfer_by_size", tuple(tuple(r) for r in self.transfer_by_size))
        object.__setattr__(self, "adam_by_threads", tuple(tuple(r) for r in self.adam_by_threads))
        if not isinstance(self.attention_tflops, Mapping):
            raise HardwareError(f"attention_tflops={self.attention_tflops!r} must map a dtype to [[seq, TFLOP/s], "
                                "...]; run megatrain-plan profile again")
        try:
            attention = {str(k): tuple(sorted((int(n), float(r)) for n, r in v))
                         for k, v in self.attention_tflops.items()}
            bad = any(not v or any(n <= 0 or not r > 0 for n, r in v) for v in attention.values())
        except (TypeError, ValueError):
            bad = True
        if bad:
            raise HardwareError(f"attention_tflops={self.attention_tflops!r} needs positive [seq, TFLOP/s] pairs "
                                "per dtype; run megatrain-plan profile again")
        object.__setattr__(self, "attention_tflops", attention)
        speedups = self.compiled_layer_speedup
        if not isinstance(speedups, Mapping) or any(
                not isinstance(r, (int, float)) or isinstance(r, bool) or not r > 0 for r in speedups.values()):
            raise HardwareError(f"compiled_layer_speedup={speedups!r} must map a dtype to a positive ratio (eager / "
                                "compiled seconds); run megatrain-plan profile --compiled-layers again")
        object.__setattr__(self, "compiled_layer_speedup", {str(k): float(r) for k, r in speedups.items()})
        if not isinstance(self.calibrations, (list, tuple)):
            raise HardwareError(f"calibrations={self.calibrations!r} must be the list megatrain-plan calibrate "
                                "writes, or absent")
        try:
            cals = tuple(c if isinstance(c, Calibration) else Calibration.from_dict(c) for c in self.calibrations)
        except CalibrationError as e:
            raise HardwareError(str(e)) from None
        object.__setattr__(self, "calibrations", cals)
        dtypes = [_dtype_name(c.compute_dtype) for c in cals]
        if len(set(dtypes)) != len(dtypes):
            raise HardwareError(f"calibrations has more than one entry for a dtype ({', '.join(dtypes)}); run "
                                "megatrain-plan calibrate again")
        _check_figures(self)

    @property
    def device_is_host(self) -> bool:
        """No GPU: the 'device' is the CPU and shares host RAM."""
        return self.gpu_mem_bytes == 0

    @property
    def adam_params_per_s(self) -> float:
        """CPU AdamW params/s as the runtime's worker runs it: every core on a GPU machine; one thread where the
        device is the CPU, whose cores the compute thread holds (the runtime's [Note: helper threads]), from
        ``adam_by_threads`` (all cores' rate over the core count where that was not measured)."""
        if not self.device_is_host:
            return self.cpu_adam_params_per_s
        one = [rate for n, rate in self.adam_by_threads if n == 1]
        return one[0] if one else self.cpu_adam_params_per_s / max(1, self.cores)

    def fitted(self, compute_dtype: str) -> Calibration | None:
        """The calibration for ``compute_dtype`` ("fp32", "bf16" or a torch name), if this profile has one."""
        return next((c for c in self.calibrations if _dtype_name(c.compute_dtype) == _dtype_name(compute_dtype)),
                    None)

    def with_calibration(self, cal: Calibration) -> "HardwareProfile":
        """This profile with ``cal`` as the calibration of its dtype (replacing an older one of that dtype)."""
        keep = tuple(c for c in self.calibrations if _dtype_name(c.compute_dtype) != _dtype_name(cal.compute_dtype))
        return dataclasses.replace(self, calibrations=keep + (cal,))

    def constants(self, compute_dtype: str) -> str:
        """Which constants the cost and memory models use for ``compute_dtype``, in words."""
        cal = self.fitted(compute_dtype)
        if cal is not None:
            return cal.describe()
        if self.calibrations:
            return (f"defaults (this profile is calibrated for "
                    f"{', '.join(c.compute_dtype for c in self.calibrations)} only; run megatrain-plan calibrate "
                    f"--dtype {compute_dtype})")
        return "defaults (run megatrain-plan calibrate to fit them on this machine)"

    @property
    def host_budget_bytes(self) -> int:
        """Host RAM a plan may fill: what is available, no more than the cgroup allows, less HOST_HEADROOM."""
        usable = self.host_available_bytes
        if self.cgroup_limit_bytes > 0:
            usable = min(usable, self.cgroup_limit_bytes)
        return int(usable * (1 - HOST_HEADROOM))

    def tflops(self, compute_dtype: str) -> float:
        """Matmul TFLOP/s for a compute dtype; float32 compute uses the fp32 figure (TF32 off)."""
        for key in (compute_dtype, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(compute_dtype)):
            if key in self.matmul_tflops:
                return float(self.matmul_tflops[key])
        raise HardwareError(f"no matmul TFLOP/s for dtype {compute_dtype!r} in this profile (has "
                            f"{', '.join(self.matmul_tflops)}); run megatrain-plan profile")

    def attention_rate_tflops(self, compute_dtype: str, seq: int) -> float | None:
        """Measured causal-attention TFLOP/s for a compute dtype at ``seq`` tokens per sequence: linear in
        log2(seq) between measured lengths, the end figures outside; None when not measured for the dtype."""
        pts = self.attention_tflops.get(_dtype_name(compute_dtype))
        return log2_interpolate(pts, seq) if pts else None

    def compiled_speedup(self, compute_dtype: str) -> float | None:
        """A decoder layer's eager / compiled time for ``compute_dtype`` as measured; None when not measured."""
        return self.compiled_layer_speedup.get(_dtype_name(compute_dtype))

    def replace(self, **changes: Any) -> "HardwareProfile":
        return dataclasses.replace(self, **changes)

    def with_overrides(self, ram_bytes: int | None = None, gpu_mem_bytes: int | None = None,
                       nvme_gbps: float | None = None) -> "HardwareProfile":
        """--ram, --gpu-mem, --nvme: replace single figures, and say so in ``source``."""
        changes: dict[str, Any] = {}
        notes = []
        if ram_bytes is not None:
            changes.update(host_ram_bytes=ram_bytes, host_available_bytes=ram_bytes, cgroup_limit_bytes=0)
            notes.append(f"ram={ram_bytes / GiB:.0f}GiB")
        if gpu_mem_bytes is not None:
            changes["gpu_mem_bytes"] = gpu_mem_bytes
            notes.append(f"gpu-mem={gpu_mem_bytes / GiB:.0f}GiB")
        if nvme_gbps is not None:
            changes.update(disk_read_gbps=nvme_gbps, disk_write_gbps=nvme_gbps)
            notes.append(f"nvme={nvme_gbps}GB/s")
        if not changes:
            return self
        return dataclasses.replace(self, source=f"{self.source}; overridden: {', '.join(notes)}", **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["transfer_by_size"] = [list(r) for r in self.transfer_by_size]
        d["adam_by_threads"] = [list(r) for r in self.adam_by_threads]
        d["attention_tflops"] = {k: [list(p) for p in v] for k, v in self.attention_tflops.items()}
        d["calibrations"] = [c.to_dict() for c in self.calibrations]
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "HardwareProfile":
        if not isinstance(data, Mapping):
            raise HardwareError(f"a hardware profile is a JSON object, got {type(data).__name__}; "
                                f"pass the file megatrain-plan profile wrote")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known - RETIRED_FIELDS)
        if unknown:
            raise HardwareError(f"unknown hardware field(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [k for k in required if k not in data]
        if missing:
            raise HardwareError(f"hardware profile lacks {', '.join(missing)}; run megatrain-plan profile again")
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as e:
            raise HardwareError(f"hardware profile has a field of the wrong type ({e}); run megatrain-plan "
                                f"profile again") from None

    @classmethod
    def from_json(cls, text: str) -> "HardwareProfile":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise HardwareError(f"hardware profile is not valid JSON ({e.msg} at line {e.lineno}); pass the "
                                f"file megatrain-plan profile wrote") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str) -> "HardwareProfile":
        try:
            with open(path, encoding="utf-8") as f:
                return cls.from_json(f.read())
        except OSError as e:
            raise HardwareError(f"cannot read hardware profile {path}: {e.strerror}; pass a preset name "
                                f"({', '.join(GPU_PRESETS)}) or a file from megatrain-plan profile") from None

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")


def _check_figures(hw: HardwareProfile) -> None:
    """Refuse a profile whose counts, rates or bandwidths are not numbers in their range (one line each)."""
    for f in ("gpu_mem_bytes", "host_ram_bytes", "host_available_bytes", "cores", "cgroup_limit_bytes",
              "cpu_adam_bytes_per_param"):
        v = getattr(hw, f)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise HardwareError(f"{f}={v!r} must be an integer >= 0 (bytes or a count); fix the profile")
    if hw.host_ram_bytes <= 0 or hw.cores <= 0:
        raise HardwareError(f"host_ram_bytes={hw.host_ram_bytes}, cores={hw.cores} must be > 0; "
                            f"pass --ram or fix the profile")
    for f in ("cpu_shadow_params_per_s", "cpu_bf16_state_params_per_s", "disk_cpu_s_per_gb", "host_memory_gbps",
              "cpu_adam_gbps", "device_adam_gbps"):
        v = getattr(hw, f)
        if not isinstance(v, (int, float)) or v < 0:
            raise HardwareError(f"{f}={v!r} must be a number >= 0 (0: not measured); run megatrain-plan "
                                "profile or fix it")
    for f in ("h2d_gbps", "d2h_gbps", "duplex_gbps", "cpu_adam_params_per_s"):
        v = getattr(hw, f)
        if not isinstance(v, (int, float)) or v <= 0:
            raise HardwareError(f"{f}={v!r} must be a positive number; run megatrain-plan profile or fix it")
    if not hw.matmul_tflops or any(not isinstance(v, (int, float)) or v <= 0
                                     for v in hw.matmul_tflops.values()):
        raise HardwareError(f"matmul_tflops={hw.matmul_tflops!r} needs positive TFLOP/s per dtype, "
                            f"e.g. {{'bfloat16': 790}}")
    if hw.host_available_bytes > hw.host_ram_bytes:
        raise HardwareError(f"host_available_bytes={hw.host_available_bytes} exceeds host_ram_bytes="
                            f"{hw.host_ram_bytes}; fix the profile")


def _dtype_name(dtype: str) -> str:
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)


def preset(gpu: str, host: str | None = None) -> HardwareProfile:
    """A HardwareProfile from a GPU preset and a host preset (the GPU's usual host when None)."""
    g = _lookup(gpu, GPU_PRESETS, "hardware")
    h = _lookup(host or g.default_host, HOST_PRESETS, "host")
    return HardwareProfile(
        gpu_name=g.name, gpu_mem_bytes=g.mem_bytes, h2d_gbps=g.h2d_gbps, d2h_gbps=g.d2h_gbps,
        duplex_gbps=g.duplex_gbps, matmul_tflops=dict(g.matmul_tflops),
        cpu_adam_params_per_s=h.cpu_adam_params_per_s, host_ram_bytes=h.ram_bytes,
        # The OS, page cache floor and other processes keep some RAM: assume 94% is available.
        host_available_bytes=int(h.ram_bytes * 0.94), cores=h.cores,
        disk_read_gbps=h.disk_read_gbps, disk_write_gbps=h.disk_write_gbps, interconnect=g.interconnect,
        source=f"preset {g.name} + {h.name}: {g.source}; host: {h.source}",
    )


def _lookup(name: str, table: Mapping[str, Any], what: str) -> Any:
    by_lower = {k.lower(): v for k, v in table.items()}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    raise HardwareError(f"unknown {what} {name!r}; valid: {', '.join(table)}"
                        + (", or a hardware.json path" if what == "hardware" else ""))


def resolve(hardware: str | HardwareProfile, host: str | None = None) -> HardwareProfile:
    """A GPU preset name (with an optional host preset), a hardware.json path, or a profile."""
    if isinstance(hardware, HardwareProfile):
        return hardware
    if hardware.lower() in {k.lower() for k in GPU_PRESETS}:
        return preset(hardware, host)
    if os.path.exists(hardware) or hardware.endswith(".json"):
        if host is not None:
            raise HardwareError(f"host preset {host!r} applies to GPU presets only; edit {hardware} or use "
                                f"--ram to change its host RAM")
        return HardwareProfile.load(hardware)
    return preset(hardware, host)  # raises the error listing valid names


def preferred_compute_dtype(hw: HardwareProfile) -> str:
    """What ``megatrain-train --compute-dtype auto`` computes in there: fp32 where the device is the CPU; on a GPU
    bf16 unless it multiplies fp32 faster."""
    rates = hw.matmul_tflops
    bf16, fp32 = rates.get("bfloat16", 0.0), rates.get("float32", 0.0)
    return "float32" if hw.device_is_host or fp32 > bf16 else "bfloat16"
