"""The AdamW update with bf16 m and v, timed for ``megatrain-plan profile`` (planner/host_rates.py runs this module
in its own process: the planner never imports the runtime, whose pass this is).

``python -m megatrain.tools.bf16_state_probe --numel N --threads T`` prints one JSON line: the params/s of the
runtime's bf16-state update (runtime/optim/bf16_adamw.py: the compiled loop where it builds, else its torch
fallback) and of torch's fused fp32 AdamW over one flat run of N elements on T intra-op threads, alternated in this
one process (on one thread by its CPU time), and whether the compiled loop ran.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from megatrain.runtime.optim import bf16_adamw
from megatrain.runtime.optim.adamw_kernel import AdamHyper
from megatrain.runtime.optim.stochastic_rounding import noise_base


def rates(numel: int, threads: int, pairs: int = 15) -> tuple[float, float]:
    """(params/s of the bf16-state update, params/s of torch's fused fp32 AdamW) over ``numel`` elements on
    ``threads`` threads (torch's count restored): the two alternated ``pairs`` times after two warm-up pairs (the
    first builds or loads the kernel and faults the pages in), the fastest of each, so a busy neighbour slows both
    alike and their ratio holds. On one thread by that thread's CPU time (``time.thread_time``: both run on it
    alone, and a quiet machine's wall time is that CPU time), which other processes on the cores hardly change."""
    before = torch.get_num_threads()
    master, grads = torch.zeros(numel), torch.randn(numel)
    m, v = torch.zeros(numel, dtype=torch.bfloat16), torch.zeros(numel, dtype=torch.bfloat16)
    p32, m32, v32, step32 = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel), torch.tensor(0.0)
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    bf16, fp32 = [], []
    clock = time.thread_time if threads == 1 else time.perf_counter
    try:
        torch.set_num_threads(threads)
        for step in range(1, pairs + 3):
            c = bf16_adamw.Constants.of(hyper, step, True, None)
            t0 = clock()
            bf16_adamw.update(master, grads, m, v, noise_base(step, 0, 0), c)
            t1 = clock()
            step32.add_(1)
            torch._fused_adamw_([p32], [grads], [m32], [v32], [], [step32], lr=hyper.lr, beta1=hyper.beta1,
                                beta2=hyper.beta2, weight_decay=hyper.weight_decay, eps=hyper.eps, amsgrad=False,
                                maximize=False)
            t2 = clock()
            if step > 2:
                bf16.append(t1 - t0)
                fp32.append(t2 - t1)
        return numel / min(bf16), numel / min(fp32)
    finally:
        torch.set_num_threads(before)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatrain.tools.bf16_state_probe",
                                description="params/s of the AdamW update with bf16 m and v on this CPU")
    p.add_argument("--numel", type=int, default=1 << 22)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    bf16, fp32 = rates(max(1, args.numel), max(1, args.threads))
    print(json.dumps({"params_per_s": bf16, "fp32_params_per_s": fp32, "compiled": bf16_adamw.uses_compiled_kernel()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
