"""Experts run over the (token, choice) pairs of a routing sorted by expert (architecture only): as two grouped
matrix multiplies (``torch._grouped_mm``) where this torch runs them well, else expert by expert.

[Note: grouped experts]
A routing's T x k (token, choice) pairs are sorted by expert once per layer pass (stable: each expert's pairs in
ascending order, the order ``torch.where(experts == e)`` gives transformers' loop), and each expert's cumulative
end among them is found on the device (``searchsorted`` on the sorted experts: no host sync, no atomics).
``add_experts`` then runs experts [first, first + g) over their pairs, either way:

- grouped: the group's pairs' tokens gathered in expert order, gate/up as one ``torch._grouped_mm`` (``offs`` the
  ends: an expert with no pair is an empty group, its gradient zero), the GLU, down as another, the per-pair
  biases gathered by expert index (gpt-oss), each row scaled by its routing weight and added into its token's
  row (one ``index_add_``, in row order on the CPU: the loop's order). A whole layer (``starts`` not read)
  needs no host sync at all; an expert group slices its rows by the host starts.
- loop: expert after expert, each over its pairs (``starts[e]:starts[e + 1]``), skipping an expert with none,
  as transformers' eager loop; the starts come from ONE host read of the counts per layer pass.

``grouped_mm_runs`` is the rule that picks the path (measured on the CPU, from torch's kernel on CUDA):

- CUDA: bf16 operands on compute capability 9.x or 10.x (torch's CUTLASS grouped kernel), every stride but the
  unit one a multiple of 16 bytes and 16-byte aligned bases (the kernel's requirement). Elsewhere torch's own
  fallback loops over the groups after reading ``offs`` to the host (one sync per call: per weight one in the
  forward and two in the backward), so megatrain's loop with one read per layer pass is the better fallback.
- CPU: float32, where torch 2.13's kernel is measured faster than the loop (``CPU_GROUPED``).

Both paths give transformers' results to float32 rounding (on the CPU the grouped path's forward and parameter
gradients are bitwise the loop's: its kernel multiplies group by group; ``tests/test_sorted_experts.py``).
torch's grouped backward refuses an expanded output gradient (zero strides, as ``sum()`` gives); every
output here feeds an op whose backward materialises its gradient (the GLU, the bias add's consumer, the weight
scaling), so none reaches it.
"""
from __future__ import annotations

import functools
from typing import Callable, Mapping, NamedTuple

import torch
from torch import nn

# The CPU's float32 path, by measurement (benchmarks/grouped_experts.py, torch 2.13, 2 shared cores): one
# qwen3-moe-100m layer's experts (h 512, 16 experts of width 576, 2 per token, 256 tokens) forward and backward
# take 0.60x the loop's time grouped with 1 thread, 0.69x with 2, 0.78x at 1024 tokens (DESIGN.md, experts).
CPU_GROUPED = True
_FAST_CUDA_MAJORS = (9, 10)  # torch's CUTLASS bf16 grouped kernel: Hopper and Blackwell


class SortedPairs(NamedTuple):
    """A routing's (token, choice) pairs sorted by expert."""
    order: torch.Tensor  # [T x k] int64: token x k + choice, sorted by expert (stable)
    experts: torch.Tensor  # [T x k] int64: the expert of each sorted pair
    ends: torch.Tensor  # [E] int32, on the device: expert e's pairs end at ends[e] (cumulative counts)
    starts: list[int] | None  # host: expert e's pairs are order[starts[e]:starts[e + 1]]; None when not read


class ExpertTensors(NamedTuple):
    """Experts [first, first + g) as the matmuls see them: input-major views of a family's fused tensors."""
    gate_up: torch.Tensor  # [g, hidden, 2I]
    down: torch.Tensor  # [g, I, hidden]
    glu: Callable[[torch.Tensor], torch.Tensor]  # [n, 2I] -> [n, I]: the family's gated activation
    gate_up_bias: torch.Tensor | None = None  # [g, 2I]
    down_bias: torch.Tensor | None = None  # [g, hidden]


class FusedExperts(nn.Module):
    """A family's experts as fused tensors (``FUSED``: their names, each [E, ...] with one row per expert, in
    registration order) that run through ``add_experts``; ``tensors`` says how the matmuls see them."""

    FUSED: tuple[str, ...] = ()

    def tensors(self, fused: Mapping[str, torch.Tensor]) -> ExpertTensors:
        """The fused tensors by name (all experts or a group's rows) as ``ExpertTensors``."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, hidden]; weights, experts [T, k] -> [T, hidden]."""
        out = torch.zeros_like(x)
        tensors = self.tensors({name: getattr(self, name) for name in self.FUSED})
        grouped = grouped_mm_runs(x, tensors)
        pairs = sort_pairs(experts, tensors.gate_up.shape[0], read_starts=not grouped)
        add_experts(out, x, weights, pairs, tensors, grouped=grouped)
        return out


def sort_pairs(experts: torch.Tensor, num_experts: int, read_starts: bool) -> SortedPairs:
    """experts [T, k] -> its pairs sorted by expert; ``read_starts``: each expert's start read to the host."""
    flat = experts.reshape(-1)
    sorted_experts, order = torch.sort(flat, stable=True)
    bounds = torch.arange(num_experts, device=flat.device, dtype=flat.dtype)
    ends = torch.searchsorted(sorted_experts, bounds, right=True, out_int32=True)
    # the loop (and an expert group's rows) must know each expert's pairs on the host: the one blocking read of
    # this layer pass, where transformers' loop reads the routing once per expert
    starts = [0] + ends.tolist() if read_starts else None
    return SortedPairs(order, sorted_experts, ends, starts)


def grouped_mm_runs(x: torch.Tensor, tensors: ExpertTensors) -> bool:
    """Whether ``add_experts`` multiplies tokens x [T, hidden] by ``tensors`` as grouped matmuls (module note)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    weights = [t for t in (tensors.gate_up, tensors.down) if t is not None]
    if x.device.type == "cpu":
        return CPU_GROUPED and all(t.dtype == torch.float32 for t in (x, *weights))
    if x.device.type != "cuda" or not all(t.dtype == torch.bfloat16 for t in (x, *weights)):
        return False
    hidden, inner = tensors.down.shape[2], tensors.down.shape[1]
    return _capability_major(x.device.index) in _FAST_CUDA_MAJORS and hidden % 8 == 0 and inner % 8 == 0 and \
        all(_aligned(t) for t in weights)


@functools.lru_cache(maxsize=None)
def _capability_major(index: int | None) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _aligned(t: torch.Tensor) -> bool:
    """16-byte aligned base and strides (the unit one aside), as the CUDA kernel needs."""
    step = 16 // t.element_size()
    return t.data_ptr() % 16 == 0 and all(s == 1 or s % step == 0 for s in t.stride())


def add_experts(out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, pairs: SortedPairs,
                tensors: ExpertTensors, first: int = 0, grouped: bool | None = None) -> bool:
    """Experts [first, first + g) over their pairs: tokens x [T, hidden], routing weights [T, k]; each pair's
    weighted output added into out [T, hidden]. ``grouped`` None: ``grouped_mm_runs`` decides. Returns whether
    any of the experts had a pair."""
    if grouped is None:
        grouped = grouped_mm_runs(x, tensors)
    g, k = tensors.gate_up.shape[0], weights.shape[1]
    if not grouped:
        assert pairs.starts is not None, "the loop reads the starts"
        return _loop(out, x, weights, pairs.order, pairs.starts[first:first + g + 1], tensors, k)
    if pairs.starts is None:
        assert first == 0 and g == pairs.ends.numel(), "without starts, experts run as one whole layer"
        lo, hi, ends = 0, pairs.order.numel(), pairs.ends
    else:
        lo, hi = pairs.starts[first], pairs.starts[first + g]
        if lo == hi:
            return False
        ends = pairs.ends[first:first + g] - lo
    rows = pairs.order[lo:hi]
    token = rows // k
    index = pairs.experts[lo:hi] - first if tensors.gate_up_bias is not None else None
    hidden = torch._grouped_mm(x[token], tensors.gate_up, offs=ends)
    if index is not None:
        hidden = hidden + tensors.gate_up_bias[index]
    y = torch._grouped_mm(tensors.glu(hidden), tensors.down, offs=ends)
    if index is not None:
        y = y + tensors.down_bias[index]
    out.index_add_(0, token, (y * weights.reshape(-1)[rows, None]).to(out.dtype))
    return True


def _loop(out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, starts: list[int],
          tensors: ExpertTensors, k: int) -> bool:
    """The loop: expert j over order[starts[j]:starts[j + 1]] (host ints), as transformers' eager loop."""
    ran = False
    # one view per expert from one unbind: its backward stacks the experts' gradients once, where indexing each
    # expert would add a zero-filled gradient of the whole fused tensor per expert
    gate_up, down = tensors.gate_up.unbind(0), tensors.down.unbind(0)
    gate_up_bias, down_bias = (None if b is None else b.unbind(0) for b in (tensors.gate_up_bias, tensors.down_bias))
    for j in range(len(gate_up)):
        lo, hi = starts[j], starts[j + 1]
        if lo == hi:
            continue
        pairs = order[lo:hi]
        token, slot = pairs // k, pairs % k
        hidden = x[token] @ gate_up[j]
        if gate_up_bias is not None:
            hidden = hidden + gate_up_bias[j]
        y = tensors.glu(hidden) @ down[j]
        if down_bias is not None:
            y = y + down_bias[j]
        out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        ran = True
    return ran
