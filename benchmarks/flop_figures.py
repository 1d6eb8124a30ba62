"""The protocol's FLOP figures of a timed step (benchmarks/README.md, "Model FLOPs"), the same in every benchmark.

Model TFLOP/s = 6 x N_matmul x (non-padded tokens) / step time (``ModelShape.model_flops_per_token``); beside it the
every-parameter figure, 6 x every active parameter (``all_params_flops_per_token``), and the same with causal
attention by the model convention (backward 2x forward, ``attention_model_flops_per_token``). MFU against two peaks:
the device's datasheet dense bf16 peak (``DATASHEET_BF16_DENSE_TFLOPS``, named by form factor) and the matmul
measured in the same run. Hardware FLOPs (recompute, flash attention's real backward) are the planner's cost model's,
reported apart where a benchmark gives them.
"""
from __future__ import annotations

from typing import Any

# Dense bf16 tensor-core peaks, TFLOP/s: NVIDIA's H100 and H200 datasheets print them "with sparsity"
# (H100 SXM 1,979, PCIe 1,513, NVL 1,671; H200 SXM 1,979, NVL 1,671); dense is half. Matched against
# torch.cuda.get_device_name(), most specific first.
DATASHEET_BF16_DENSE_TFLOPS: tuple[tuple[str, str, float], ...] = (
    ("H200 NVL", "H200 NVL", 835.5),
    ("H200", "H200 SXM", 989.5),
    ("H100 NVL", "H100 NVL", 835.5),
    ("H100 PCIe", "H100 PCIe", 756.5),
    ("H100", "H100 SXM", 989.5),  # "NVIDIA H100 80GB HBM3": the SXM5 board
)


def datasheet_peak(gpu_name: str | None) -> tuple[str, float] | None:
    """(form factor, dense bf16 TFLOP/s) of a device by its CUDA name, or None when the table does not know it."""
    if not gpu_name:
        return None
    for key, form, tflops in DATASHEET_BF16_DENSE_TFLOPS:
        if key.lower() in gpu_name.lower():
            return form, tflops
    return None


def figures(shape: Any, tokens: int, seconds: float, seq: int, measured_peak_tflops: float | None = None,
            gpu_name: str | None = None) -> dict[str, Any]:
    """The protocol's figures of ``tokens`` non-padded tokens in rows of ``seq`` trained in ``seconds`` by a model of
    ``shape`` (a planner ``ModelShape``). MFU keys are None where that peak is not known."""
    rate = tokens / seconds
    model = shape.model_flops_per_token() * rate / 1e12
    attention = shape.attention_model_flops_per_token(seq) * rate / 1e12
    sheet = datasheet_peak(gpu_name)
    out: dict[str, Any] = {
        "matmul_params_active": shape.matmul_params_active, "params_active": shape.params_active,
        "model_tflops": model, "all_params_tflops": shape.all_params_flops_per_token() * rate / 1e12,
        "attention_tflops": attention, "model_tflops_with_attention": model + attention,
        "mfu_measured_matmul": model / measured_peak_tflops if measured_peak_tflops else None,
        "datasheet_peak": {"device": sheet[0], "bf16_dense_tflops": sheet[1]} if sheet else None,
        "mfu_datasheet": model / sheet[1] if sheet else None,
    }
    return out
