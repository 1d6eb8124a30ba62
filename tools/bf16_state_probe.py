"""The AdamW update with bf16 m and v, timed for ``megatrain-plan profile`` (planner/host_rates.py runs this module
in its own process: the planner never imports the runtime, whose pass this is).

``python -m megatrain.tools.bf16_state_probe --numel N --threads T`` prints one JSON line: the params/s of the
runtime's bf16-state update (runtime/optim/bf16_adamw.py: the compiled loop where it builds, else its torch
fallback) over one flat run of N elements on T intra-op threads, best of 3 after two warm-up calls (the first
builds or loads the kernel and faults the pages in), and whether the compiled loop ran.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from megatrain.planner.host_rates import best_of
from megatrain.runtime.optim import bf16_adamw
from megatrain.runtime.optim.adamw_kernel import AdamHyper
from megatrain.runtime.optim.stochastic_rounding import noise_base


def rate(numel: int, threads: int) -> float:
    """Params/s of the bf16-state update of ``numel`` elements on ``threads`` threads (torch's count restored)."""
    before = torch.get_num_threads()
    master, grads = torch.zeros(numel), torch.randn(numel)
    m, v = torch.zeros(numel, dtype=torch.bfloat16), torch.zeros(numel, dtype=torch.bfloat16)
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    step = [0]

    def once() -> float:
        step[0] += 1
        c = bf16_adamw.Constants.of(hyper, step[0], True, None)
        t0 = time.perf_counter()
        bf16_adamw.update(master, grads, m, v, noise_base(step[0], 0, 0), c)
        return time.perf_counter() - t0

    try:
        torch.set_num_threads(threads)
        for _ in range(2):
            once()
        return numel / best_of(once, 3)
    finally:
        torch.set_num_threads(before)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatrain.tools.bf16_state_probe",
                                description="params/s of the AdamW update with bf16 m and v on this CPU")
    p.add_argument("--numel", type=int, default=1 << 22)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    params_per_s = rate(max(1, args.numel), max(1, args.threads))
    print(json.dumps({"params_per_s": params_per_s, "compiled": bf16_adamw.uses_compiled_kernel()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
