"""Measure this machine into a HardwareProfile (``megatrain-plan profile``), or detect it quickly.

The only planner module that imports torch, and only inside the functions that need it; the host's own figures
(memory, limits) are ``host_probe``'s, the disk's ``disk_profile``'s. ``measure`` runs the
benchmarks (a few seconds on a CPU-only machine, where sizes are scaled down); ``detect`` runs none: it reads the
host's memory limits and, when a GPU is present, takes its rates from the matching preset.

Without a GPU the device is the CPU: the profile has gpu_mem_bytes = 0, its "H2D/D2H" figures are host memcpy
rates and its matmul rates are the CPU's. The profile's ``source`` says so.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import os
import time
from typing import Any, Callable

from megatrain.planner.profiling import compiled_speedup, profile_checks
from megatrain.planner.profiling.disk_profile import NOT_MEASURED, measure_disk
from megatrain.planner.profiling.hardware import (DEVICE_ADAM_BYTES_PER_PARAM, HOST_PRESETS, MiB, HardwareProfile,
                                                  preset)
from megatrain.planner.profiling.host_probe import gpu_present, host_memory
from megatrain.planner.profiling.host_rates import (adam_bytes_per_param, cpu_adam_rate, cpu_bf16_state_rate,
                                                    cpu_copy_gbps, cpu_memory_gbps, cpu_shadow_rate)

CACHE_PATH = os.path.join(os.path.expanduser("~"), ".cache", "megatrain", "hardware.json")
TRANSFER_SIZES_GPU = tuple(1 << s for s in range(20, 31, 2))      # 1 MiB .. 1 GiB
DTYPES_GPU = ("bfloat16", "float16", "tf32", "float32")
# Sequence lengths of the causal-attention measurement (heads x head_dim: 32 x 128 on a GPU, 4 x 64 on a CPU);
# longer contexts take the longest length's rate.
ATTENTION_SEQS_GPU = (1024, 4096, 16384, 65536)
ATTENTION_SEQS_CPU = (256, 1024, 4096)
ATTENTION_DTYPES_GPU = ("bfloat16", "float16", "float32")
# Parameters of the device AdamW measurement: four fp32 buffers of 2^27 elements, 2 GiB on the GPU (far beyond its
# caches, as a resident block's buffers are).
DEVICE_ADAM_NUMEL = 1 << 27


# ---- torch measurements ------------------------------------------------------------------------

def _quiet(line: str) -> None:
    """A ``log`` that says nothing."""


def _best_of(fn: Callable[[], float], repeats: int, what: str = "", log: Callable[[str], None] = _quiet) -> float:
    """The fastest of ``repeats`` samples; a round spread above profile_checks.SAMPLE_SPREAD_MAX is measured
    again, and ``log`` says so ([profile_checks.steady_minimum])."""
    return profile_checks.steady_minimum(lambda: [fn() for _ in range(repeats)], what or "a sample", log)


def matmul_tflops(device: str, dtypes: tuple[str, ...], n: int, repeats: int = 3,
                  log: Callable[[str], None] = _quiet) -> dict[str, float]:
    """Dense n x n x n matmul TFLOP/s per dtype (2 n^3 FLOPs). "tf32" is float32 with TF32 allowed."""
    import torch
    out = {}
    on_gpu = device.startswith("cuda")
    for name in dtypes:
        dt = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)
        if on_gpu:
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
        a = torch.randn(n, n, device=device, dtype=dt)
        b = torch.randn(n, n, device=device, dtype=dt)

        def once() -> float:
            if on_gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(4):
                    torch.mm(a, b)
                end.record()
                end.synchronize()
                return start.elapsed_time(end) / 1e3 / 4
            t0 = time.perf_counter()
            torch.mm(a, b)
            return time.perf_counter() - t0

        once()
        out[name] = 2 * n ** 3 / _best_of(once, repeats, f"{name} matmul", log) / 1e12
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = False
    return out


def attention_tflops(device: str, dtypes: tuple[str, ...], seqs: tuple[int, ...], heads: int, head_dim: int,
                     log: Callable[[str], None] = _quiet) -> dict[str, tuple[tuple[int, float], ...]]:
    """Causal attention TFLOP/s per dtype and sequence length, forward + backward of one sequence through
    scaled_dot_product_attention(is_causal=True), as the runtime calls it; FLOPs counted as the planner counts
    them: seq x attention_flops_per_token x (1 + ATTENTION_BWD_FACTOR). On CUDA, bf16 and fp16 run the
    flash kernel (the runtime requires it) and fp32 the default choice. A length that does not fit or has
    no kernel is left out."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatrain.planner.shapes.model_flops import ATTENTION_BWD_FACTOR, attention_flops_per_token

    on_gpu = device.startswith("cuda")
    out: dict[str, tuple[tuple[int, float], ...]] = {}
    for name in dtypes:
        dt = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)
        flash = on_gpu and dt != torch.float32
        pts = []
        for seq in seqs:
            try:
                q, k, v = (torch.randn(1, heads, seq, head_dim, device=device, dtype=dt, requires_grad=True)
                           for _ in range(3))
                dy = torch.randn(1, heads, seq, head_dim, device=device, dtype=dt)

                def once() -> float:
                    if on_gpu:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if flash else contextlib.nullcontext():
                        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                    y.backward(dy)
                    if on_gpu:
                        torch.cuda.synchronize()
                    return time.perf_counter() - t0

                once()
                seconds = _best_of(once, 3, f"{name} causal attention at {seq} tokens", log)
            except RuntimeError:  # torch.cuda.OutOfMemoryError is one too
                continue  # too long for this device, or no kernel for the dtype: not measured there
            finally:
                q = k = v = dy = None
            flops = seq * attention_flops_per_token(heads, head_dim, seq) * (1 + ATTENTION_BWD_FACTOR)
            pts.append((seq, flops / seconds / 1e12))
        if pts:
            out[name] = tuple(pts)
    return out


def attention_rates(on_gpu: bool, dtypes: tuple[str, ...],
                    log: Callable[[str], None] = _quiet) -> dict[str, tuple[tuple[int, float], ...]]:
    """``attention_tflops`` at the profile's sizes: on a GPU 32 heads x 128 over ATTENTION_SEQS_GPU, on a CPU
    4 heads x 64 over ATTENTION_SEQS_CPU."""
    if on_gpu:
        return attention_tflops("cuda", dtypes, ATTENTION_SEQS_GPU, 32, 128, log)
    return attention_tflops("cpu", dtypes, ATTENTION_SEQS_CPU, 4, 64, log)


def plausible_attention(matmul: dict[str, float], attention: dict[str, tuple[tuple[int, float], ...]],
                        on_gpu: bool, log: Callable[[str], None]
                        ) -> tuple[dict[str, tuple[tuple[int, float], ...]], list[profile_checks.Implausible]]:
    """The attention rates, each dtype found implausible against its matmul rate
    (``profile_checks.attention_findings``) measured again, up to REMEASURE_TRIES measurements in all, with
    ``log`` saying so; and the findings still standing after that (kept, for the caller to name)."""
    out = dict(attention)
    for attempt in range(2, profile_checks.REMEASURE_TRIES + 1):
        bad = profile_checks.attention_findings(matmul, out)
        if not bad:
            return out, []
        for f in bad:
            log(f"{f.line()}: measuring it again ({attempt}/{profile_checks.REMEASURE_TRIES})")
        out.update(attention_rates(on_gpu, tuple(f.dtype for f in bad), log))
    left = profile_checks.attention_findings(matmul, out)
    for f in left:
        log(f"{f.line()}: kept after {profile_checks.REMEASURE_TRIES} measurements; profile again on a quiet machine")
    return out, left


def gpu_transfers(sizes: tuple[int, ...]) -> list[tuple[int, float, float, float]]:
    """(bytes, H2D, D2H, both-at-once total) GB/s between pinned host memory and the GPU, by size,
    timed with CUDA events on two copy streams."""
    import torch
    out = []
    for size in sizes:
        host_src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        host_dst = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        dev_a = torch.empty(size, dtype=torch.uint8, device="cuda")
        dev_b = torch.empty(size, dtype=torch.uint8, device="cuda")
        # One stream per direction, as in the runtime, so the duplex figure is real overlap.
        s_h2d, s_d2h = torch.cuda.Stream(), torch.cuda.Stream()

        def timed(h2d: bool, d2h: bool) -> float:
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end_h, end_d = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            s_h2d.wait_event(start)
            s_d2h.wait_event(start)
            if h2d:
                with torch.cuda.stream(s_h2d):
                    dev_a.copy_(host_src, non_blocking=True)
            if d2h:
                with torch.cuda.stream(s_d2h):
                    host_dst.copy_(dev_b, non_blocking=True)
            end_h.record(s_h2d)
            end_d.record(s_d2h)
            torch.cuda.synchronize()
            return max(start.elapsed_time(end_h), start.elapsed_time(end_d)) / 1e3

        timed(True, True)
        h2d = size / _best_of(lambda: timed(True, False), 3) / 1e9
        d2h = size / _best_of(lambda: timed(False, True), 3) / 1e9
        both = 2 * size / _best_of(lambda: timed(True, True), 3) / 1e9
        out.append((size, h2d, d2h, both))
        del host_src, host_dst, dev_a, dev_b
    return out


def device_adam_gbps(numel: int = DEVICE_ADAM_NUMEL, log: Callable[[str], None] = _quiet) -> float:
    """GB/s of torch's fused AdamW on the GPU, as the runtime's device AdamW updates a resident block: one
    ``torch._fused_adamw_`` over flat fp32 master, gradient, m and v buffers of ``numel`` elements on the device,
    its step count a float32 device scalar; DEVICE_ADAM_BYTES_PER_PARAM bytes a parameter x params/s, timed with
    CUDA events over 4 updates."""
    import torch
    p, g, m, v = (torch.rand(numel, device="cuda") for _ in range(4))
    step = torch.zeros((), dtype=torch.float32, device="cuda")

    def once() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(4):
            step.add_(1)
            torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01,
                                eps=1e-8, amsgrad=False, maximize=False)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / 4

    try:
        once()
        seconds = _best_of(once, 3, "device AdamW", log)
    finally:
        del p, g, m, v
        torch.cuda.empty_cache()
    return numel * DEVICE_ADAM_BYTES_PER_PARAM / seconds / 1e9


def interconnect_label(name: str) -> str:
    """NVLink-C2C for Grace Hopper, else PCIe generation and width from NVML when it is installed."""
    if "GH200" in name or "GB200" in name:
        return "NVLink-C2C"
    try:
        import pynvml  # type: ignore[import-not-found]
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        gen = pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h)
        width = pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)
        return f"PCIe Gen{gen} x{width}"
    except Exception:  # NVML absent or refusing: the label is informational only
        return "PCIe (generation unknown: NVML not available)"


def _matching_preset(name: str) -> str | None:
    """The GPU preset for a device name as torch reports it ("NVIDIA H100 80GB HBM3"), if any."""
    k = name.lower()
    rules = (("gh200", "GH200"), ("h200", "H200"), ("h100", "H100-PCIe" if "pcie" in k else "H100-SXM"),
             ("a100", "A100-80GB" if "80g" in k else "A100-40GB"), ("l40s", "L40S"),
             ("4090", "RTX-4090"), ("3090", "RTX-3090"))
    return next((preset_name for key, preset_name in rules if key in k), None)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def measure(spill_dir: str | None = None, log: Callable[[str], None] = lambda s: None,
            compiled_layers: bool = False) -> HardwareProfile:
    """Benchmark this machine. A few seconds without a GPU; about a minute with one, one or two more with
    ``compiled_layers`` (a decoder layer compiled and timed against eager in bf16: compiled_speedup.py; a GPU's
    only)."""
    import torch
    total, avail, cg = host_memory()
    cores = os.cpu_count() or 1
    threads = sorted({1, max(1, cores // 2), cores})
    on_gpu = gpu_present() and torch.cuda.is_available()
    notes = []
    log(f"CPU AdamW (torch fused, flat fp32 buffer) over threads {threads}")
    adam = cpu_adam_rate(1 << 22 if not on_gpu else 1 << 26, threads)
    adam_threads, adam_rate = max(adam, key=lambda tr: tr[1])
    log(f"host memory bandwidth (triad) on {adam_threads} threads")
    memory_gbps = cpu_memory_gbps(1 << 25, adam_threads)
    log("CPU fp32 -> bf16 shadow rounding")
    shadow = cpu_shadow_rate(1 << 22 if not on_gpu else 1 << 26)
    log("CPU AdamW with bf16 state (one pass: m and v widened, updated, rounded back)")
    # on the AdamW worker's threads: one where the device is the CPU ([Note: helper threads]), every core on a GPU
    worker = 1 if not on_gpu else cores
    bf16_state = cpu_bf16_state_rate(1 << 22, worker, dict(adam).get(worker))  # at fp32 AdamW's rate x their ratio
    if not bf16_state:
        notes.append("AdamW with bf16 state not measured (python -m megatrain.tools.bf16_state_probe failed)")
    disk = measure_disk(spill_dir, cpu_matmul(), log) if spill_dir else {}
    if not spill_dir:
        notes.append(f"{NOT_MEASURED} (pass --spill-dir)")
    if on_gpu:
        props = torch.cuda.get_device_properties(0)
        name, mem = props.name, int(props.total_memory)
        log(f"pinned H2D/D2H on {name}, sizes 1 MiB .. 1 GiB")
        table = gpu_transfers(TRANSFER_SIZES_GPU)
        big = table[-1]
        h2d, d2h, duplex = big[1], big[2], big[3]
        log("GPU matmul TFLOP/s")
        tflops = matmul_tflops("cuda", DTYPES_GPU, 8192, log=log)
        log("GPU fused AdamW (fp32 device buffers: the resident blocks' update)")
        device_adam = device_adam_gbps(log=log)
        log("GPU causal attention TFLOP/s (forward + backward), 1k .. 64k tokens")
        link = interconnect_label(name)
    else:
        notes.append("no GPU: the device is the CPU; transfers are host memcpy, matmul is CPU; "
                     "H2D/D2H over PCIe and the GPU's AdamW not measured")
        name, mem, table, device_adam = "cpu", 0, [], 0.0
        log("host memcpy and CPU matmul (no GPU)")
        h2d = d2h = cpu_copy_gbps()
        duplex = h2d
        tflops = matmul_tflops("cpu", ("float32", "bfloat16"), 1024, log=log)
        log("CPU causal attention TFLOP/s (fp32, forward + backward), 256 .. 4k tokens")
        link = "none"
    attention, off = plausible_attention(tflops, attention_rates(on_gpu, ATTENTION_DTYPES_GPU if on_gpu else
                                                                 ("float32",), log), on_gpu, log)
    notes += [f"{f.line()} (kept after {profile_checks.REMEASURE_TRIES} measurements)" for f in off]
    speedups: dict[str, float] = {}
    if compiled_layers and on_gpu:
        log("a decoder layer eager against torch.compile (bf16, Llama-3.1-8B's shape; compiling takes a while)")
        speedups, why = compiled_speedup.measure("cuda", "bfloat16", log)
        notes += [why] if why else []
    elif compiled_layers:
        notes.append("compiled layers not measured: a GPU's only")
    return HardwareProfile(
        gpu_name=name, gpu_mem_bytes=mem, h2d_gbps=h2d, d2h_gbps=d2h, duplex_gbps=duplex, matmul_tflops=tflops,
        cpu_adam_params_per_s=adam_rate, host_ram_bytes=total, host_available_bytes=avail,
        cgroup_limit_bytes=cg, **disk, interconnect=link, cores=cores,
        source=f"measured by megatrain-plan profile on {_now()}" + (f"; {'; '.join(notes)}" if notes else ""),
        transfer_by_size=tuple(table), adam_by_threads=tuple(adam), cpu_shadow_params_per_s=shadow,
        cpu_bf16_state_params_per_s=bf16_state, host_memory_gbps=memory_gbps,
        cpu_adam_bytes_per_param=adam_bytes_per_param(), cpu_adam_gbps=adam_bytes_per_param() * adam_rate / 1e9,
        device_adam_gbps=device_adam, attention_tflops=attention, compiled_layer_speedup=speedups)


def cpu_matmul() -> Callable[[], Any]:
    """A small CPU matmul (two 512-square fp32 matrices): the compute the disk's I/O is timed beside."""
    import torch
    return functools.partial(torch.mm, *torch.randn(2, 512, 512))


def detect() -> HardwareProfile:
    """This machine without benchmarks: host limits from the OS; a GPU's rates from its preset, its host's
    (AdamW, disk) from the host preset nearest its core count (not the GPU's usual server host).

    Without a GPU, CPU rates are rough guesses (memcpy 5 GB/s, 0.05 TFLOP/s per core, AdamW
    0.3 Gparam/s per core); ``source`` says to run ``megatrain-plan profile`` for real figures.
    """
    total, avail, cg = host_memory()
    cores = os.cpu_count() or 1
    common: dict[str, Any] = dict(host_ram_bytes=total, host_available_bytes=avail, cgroup_limit_bytes=cg,
                                  cores=cores)
    if gpu_present():
        try:
            import torch
            if torch.cuda.is_available():
                props = torch.cuda.get_device_properties(0)
                match = _matching_preset(props.name)
                if match is not None:
                    base = preset(match, min(HOST_PRESETS.values(), key=lambda h: abs(h.cores - cores)).name)
                    return base.replace(
                        gpu_name=props.name, gpu_mem_bytes=int(props.total_memory), interconnect=
                        interconnect_label(props.name), source=f"detected {props.name}; rates from preset "
                        f"{match} (run megatrain-plan profile to measure); {base.source}", **common)
        except ImportError:
            pass
    return HardwareProfile(
        gpu_name="cpu", gpu_mem_bytes=0, h2d_gbps=5.0, d2h_gbps=5.0, duplex_gbps=5.0,
        matmul_tflops={"float32": 0.05 * cores, "bfloat16": 0.05 * cores},
        cpu_adam_params_per_s=0.3e9 * cores, interconnect="none",
        source="detected: no GPU; CPU rates are rough guesses, run megatrain-plan profile to measure", **common)


def this_machine() -> HardwareProfile:
    """The saved profile ($MEGATRAIN_HARDWARE or ~/.cache/megatrain/hardware.json) if any, else detect()."""
    path = os.environ.get("MEGATRAIN_HARDWARE") or CACHE_PATH
    if os.path.exists(path):
        return HardwareProfile.load(path)
    return detect()
