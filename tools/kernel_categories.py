"""What the traced steps' kernels were: each kernel's time in a category by its name (GEMM, attention, ...).

``CATEGORIES`` is the one table: an ordered list of (category, name fragments); a kernel (or, on a CPU, an
operator) falls in the first category one of whose fragments its lowercased name contains, else in "other".
The order settles names that match two rows: flash attention's kernels are CUTLASS kernels (attention before
gemm), a cast is an elementwise kernel running ``direct_copy`` (copy before elementwise), cross-entropy's
``log_softmax`` is a softmax (cross_entropy before elementwise).

What is counted, per step (``kernel_breakdown``):

- on CUDA (the trace has device kernels): every device record but the DMA copies and memsets (``Memcpy ...``,
  ``Memset ...``: tools/trace_anatomy.py's H2D and D2H), each for its whole duration. The categories sum to
  ``total_s``, the kernels' summed time, which is trace_anatomy's ``compute_s`` where no two kernels overlap
  (kernels on two streams at once count twice here, once there). A ``copy`` kernel is the SMs' own copying:
  casts, ``contiguous``, concatenation.
- on a CPU (no device records): every operator's self time (its time less its children's), so nested
  operators count once: ``aten::linear``'s own microseconds, its ``aten::mm`` child's in gemm. The total is the
  time the traced threads spent inside operators and labelled ranges, the AdamW worker's included; the
  labelled ranges' own time (``fwd[3]``'s Python between operators) is "other".

Norms, RoPE and SwiGLU run as plain elementwise and reduction kernels in eager PyTorch (``pow``, ``mean``,
``rsqrt``, ``mul``, ``silu``): their kernels' names do not say which layer part launched them, so they are
"elementwise" together; a fused kernel (Liger's ``_rms_norm_forward_kernel``, ``_rope_forward_kernel``,
``_swiglu_forward_kernel``) falls in its own row. torch.compile's generated kernels (``Plan.compiled_layers``:
inductor's ``triton_poi_fused_*``, ``triton_red_fused_*``, ``triton_per_fused_*`` on CUDA; on a CPU its C++ runs
inside the ``## Call CompiledFxGraph`` range) are named after the operators they fuse, a cast's ``_to_copy`` among
them: "compiled", before copy takes them. ``top`` lists the kernels with the most time, so a name that the table
puts in "other" shows there.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch

# (category, lowercase name fragments), first match wins. CUDA kernel names (cuBLAS: nvjet_*, sm90_xmma_gemm_*,
# cutlass_*; flash attention: flash_fwd_kernel, cuDNN's *sdpa*, fmha_*) and CPU operator names (aten::mm, ...).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "attention", "sdpa", "fmha", "attn")),
    ("optimizer", ("adam", "lpnorm", "_foreach")),  # AdamW; the gradient norm clipping takes
    ("gemm", ("gemm", "matmul", "nvjet", "xmma", "cublas", "cutlass", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::baddbmm", "aten::linear", "grouped_mm")),
    ("compiled", ("triton_poi_", "triton_red_", "triton_per_", "cpp_fused_", "compiledfxgraph")),  # inductor's
    ("norm", ("rms_norm", "layer_norm", "rmsnorm", "layernorm")),
    ("rope", ("_rope", "rope_", "rotary")),  # not bare "rope": "property" holds it
    ("swiglu", ("swiglu", "geglu")),
    ("cross_entropy", ("cross_entropy", "crossentropy", "log_softmax", "logsoftmax", "nll_loss")),
    ("copy", ("copy", "memcpy", "aten::to", "aten::_to_copy", "aten::cat", "aten::contiguous")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "softmax", "silu", "gelu", "rsqrt", "pow", "aten::mul",
                     "aten::add", "aten::sub", "aten::div", "aten::neg", "aten::mean", "aten::sum", "aten::exp",
                     "aten::where", "aten::fill_", "aten::zero_", "fill", "index", "gather", "scatter",
                     "embedding")),
)
OTHER = "other"
ORDER = tuple(c for c, _ in CATEGORIES) + (OTHER,)
TOP = 15  # the kernels listed by time


def category(name: str) -> str:
    """The category of a kernel or operator named ``name`` (``CATEGORIES``'s first match; "other")."""
    low = name.lower()
    for cat, fragments in CATEGORIES:
        if any(f in low for f in fragments):
            return cat
    return OTHER


def _dma(name: str) -> bool:
    """A DMA copy or memset record: the copy engines' work, not a kernel (trace_anatomy's H2D and D2H)."""
    return name.startswith(("Memcpy", "Memset"))


def kernel_breakdown(events: Iterable[Any], steps: int) -> dict[str, Any]:
    """Seconds per step of each category in ``events`` (a profiler's ``events()`` covering ``steps`` whole
    steps), their share of ``total_s``, and the ``TOP`` kernels (name, category, seconds per step)."""
    events = list(events)
    device = [ev for ev in events if ev.device_type == torch.autograd.DeviceType.CUDA and not _dma(ev.name)]
    by_name: dict[str, float] = defaultdict(float)  # microseconds over all traced steps
    if device:
        for ev in device:
            by_name[ev.name] += ev.time_range.end - ev.time_range.start
    else:
        for ev in events:
            if ev.device_type == torch.autograd.DeviceType.CPU:
                by_name[ev.name] += max(0.0, ev.self_cpu_time_total)
    seconds = dict.fromkeys(ORDER, 0.0)
    for name, us in by_name.items():
        seconds[category(name)] += us / 1e6 / steps
    total = sum(seconds.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP]
    return {"source": "cuda" if device else "cpu", "total_s": total, "seconds": seconds,
            "share": {c: (s / total if total > 0 else 0.0) for c, s in seconds.items()},
            "top": [{"name": n[:160], "category": category(n), "seconds": us / 1e6 / steps} for n, us in top]}
