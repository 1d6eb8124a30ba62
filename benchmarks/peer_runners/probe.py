"""The machine's description and its matmul peak, measured in a subprocess of the same run.

In a subprocess so that the parent never creates a CUDA context (which would hold GPU
memory through every run). The peak is the median of timed square matrix products after
warm-up: bf16 8192^3 on CUDA (cuda events), fp32 1024^3 on a CPU. MFU is model TFLOP/s
over this number.
"""
from __future__ import annotations

import importlib.metadata
import json
import statistics
import subprocess
import time
from typing import Any

from result_files import machine  # benchmarks/result_files.py, beside this package

from . import memory


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def matmul_peak(device: str) -> dict[str, Any]:
    """Median TFLOP/s of square matrix products: bf16 n=8192 on CUDA, fp32 n=1024 on a CPU."""
    import torch

    if device == "cuda":
        n, dtype, reps = 8192, torch.bfloat16, 10
    else:
        n, dtype, reps = 1024, torch.float32, 5
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)  # random data: zeros run faster
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    for _ in range(3):
        a @ b
    seconds = []
    for _ in range(reps):
        if device == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            stop.record()
            stop.synchronize()
            seconds.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            a @ b
            seconds.append(time.perf_counter() - t0)
    return {"tflops": 2 * n**3 / statistics.median(seconds) / 1e12, "dtype": str(dtype).replace("torch.", ""),
            "n": n, "reps": reps}


def describe(device_request: str) -> dict[str, Any]:
    """Machine description, the device the runs will use, and the matmul peak on it."""
    import torch

    cuda = torch.cuda.is_available()
    device = "cuda" if (device_request == "cuda" or (device_request == "auto" and cuda)) else "cpu"
    if device == "cuda" and not cuda:
        raise SystemExit("--device cuda: no CUDA device is visible to torch")
    info: dict[str, Any] = {
        **machine(), "device": device, "cuda_available": cuda, "cuda": torch.version.cuda,
        "transformers": _version("transformers"), "deepspeed": _version("deepspeed"),
        "usable_cores": memory.usable_cores(), "torch_threads": torch.get_num_threads(),
        "host_ram_bytes": memory.host_total(), "host_available_bytes": memory.host_available(),
    }
    if cuda:
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_bytes=int(p.total_memory), gpu_sms=p.multi_processor_count,
                    gpu_capability=f"{p.major}.{p.minor}", driver=_driver())
    info["matmul_peak"] = matmul_peak(device)
    return info


def main(path: str, device_request: str) -> int:
    info = describe(device_request)
    with open(path, "w") as f:
        json.dump(info, f)
    return 0
