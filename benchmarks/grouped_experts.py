"""One sparse layer's experts, forward and backward: torch._grouped_mm against megatrain's per-expert loop.

Times what ``Experts.forward`` (models/layers/moe.py) computes, and its backward, on the path
``sorted_experts.add_experts`` is told to take (the loop reading the starts once, as it does), the two paths
alternating round by round on the same routing, and prints the median of the per-round ratios (grouped / loop)
with the load average: what ``sorted_experts.CPU_GROUPED`` is chosen by.

    python benchmarks/grouped_experts.py --tokens 256 --rounds 20 [--dtype float32] [--device cpu]

Default shape: benchmarks/moe.py's qwen3-moe-100m layer (h 512, 16 experts of width 576, 2 per token).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from types import SimpleNamespace

import torch

from megatrain.models.layers import sorted_experts
from megatrain.models.layers.moe import Experts


def one_pass(experts: Experts, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, grouped: bool,
             device: str) -> float:
    x = x.detach().requires_grad_()
    start = time.perf_counter()
    out = torch.zeros_like(x)
    pairs = sorted_experts.sort_pairs(chosen, experts.gate_up_proj.shape[0], read_starts=not grouped)
    sorted_experts.add_experts(out, x, weights, pairs, experts.tensors(dict(experts.named_parameters())),
                               grouped=grouped)
    torch.autograd.grad(out, (x, experts.gate_up_proj, experts.down_proj), torch.ones_like(out))
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--width", type=int, default=576)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, a.dtype)
    config = SimpleNamespace(num_experts=a.experts, hidden_size=a.hidden, moe_intermediate_size=a.width,
                             hidden_act="silu")
    experts = Experts(config).to(a.device, dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(a.tokens, a.hidden, device=a.device, dtype=dtype)
    logits = torch.randn(a.tokens, a.experts, device=a.device)
    weights, chosen = torch.topk(torch.softmax(logits, -1), a.top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    rule = sorted_experts.grouped_mm_runs(x, experts.tensors(dict(experts.named_parameters())))
    load_before = os.getloadavg()[0]
    for grouped in (True, False):  # warm-up
        one_pass(experts, x, weights, chosen, grouped, a.device)
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(a.rounds):
        for grouped in ((True, False) if r % 2 == 0 else (False, True)):
            times[grouped].append(one_pass(experts, x, weights, chosen, grouped, a.device))
    ratios = [g / l for g, l in zip(times[True], times[False])]
    print(json.dumps({
        "shape": dict(tokens=a.tokens, hidden=a.hidden, width=a.width, experts=a.experts, top_k=a.top_k),
        "dtype": a.dtype, "device": a.device, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "rule_picks": "grouped" if rule else "loop",
        "median_s": {"grouped": statistics.median(times[True]), "loop": statistics.median(times[False])},
        "median_ratio_grouped_over_loop": statistics.median(ratios),
        "load_1min": {"before": load_before, "after": os.getloadavg()[0]}}, indent=1))


if __name__ == "__main__":
    main()
