"""AdamW with bf16 m and v (runtime/optim/bf16_adamw.py) against torch's fused fp32 AdamW, in one process.

    python benchmarks/bf16_state_adamw.py [--numel 4194304] [--threads 1 2] [--repeats 15]

For each thread count: the two updates over one flat run of ``numel`` parameters, alternated ``repeats`` times
(so a busy neighbour slows both alike), the fastest of each; params/s and their ratio, with the load average
(``os.getloadavg``) before and after, and which bf16 path ran (the compiled loop or the torch fallback). On one
thread also by the calling thread's CPU time (``time.thread_time``: both updates run on it alone), which a machine
shared with other work slows far less than the wall clock.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from megatrain.runtime.optim import bf16_adamw
from megatrain.runtime.optim.adamw_kernel import AdamHyper
from megatrain.runtime.optim.stochastic_rounding import noise_base

HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def compare(numel: int, threads: int, repeats: int) -> tuple[float, float, float, float]:
    """(fp32 AdamW params/s, bf16-state AdamW params/s) by the wall clock, then by the thread's CPU time, the best
    of ``repeats`` alternated runs each."""
    torch.set_num_threads(threads)
    p32, g, m32, v32 = torch.zeros(numel), torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
    p16, m16, v16 = torch.zeros(numel), torch.zeros(numel, dtype=torch.bfloat16), torch.zeros(numel,
                                                                                              dtype=torch.bfloat16)
    step = torch.tensor(0.0)
    fp32, bf16, fp32_cpu, bf16_cpu = [], [], [], []
    for k in range(repeats + 2):  # two warm-up rounds fault the pages in (and build or load the kernel)
        step.add_(1)
        t0, c0 = time.perf_counter(), time.thread_time()
        torch._fused_adamw_([p32], [g], [m32], [v32], [], [step], lr=HYPER.lr, beta1=HYPER.beta1,
                            beta2=HYPER.beta2, weight_decay=HYPER.weight_decay, eps=HYPER.eps, amsgrad=False,
                            maximize=False)
        t1, c1 = time.perf_counter(), time.thread_time()
        bf16_adamw.update(p16, g, m16, v16, noise_base(k + 1, 0, 0),
                          bf16_adamw.Constants.of(HYPER, k + 1, True, None))
        t2, c2 = time.perf_counter(), time.thread_time()
        if k >= 2:
            fp32.append(t1 - t0)
            bf16.append(t2 - t1)
            fp32_cpu.append(c1 - c0)
            bf16_cpu.append(c2 - c1)
    return numel / min(fp32), numel / min(bf16), numel / min(fp32_cpu), numel / min(bf16_cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=1 << 22)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    print(f"bf16 path: {'compiled loop' if bf16_adamw.uses_compiled_kernel() else 'torch fallback'}; "
          f"{args.numel:,} parameters")
    for threads in args.threads:
        load = os.getloadavg()[0]
        fp32, bf16, fp32_cpu, bf16_cpu = compare(args.numel, threads, args.repeats)
        cpu = (f"; by CPU time {fp32_cpu / 1e9:.3f} and {bf16_cpu / 1e9:.3f}, {bf16_cpu / fp32_cpu:.2f}x"
               if threads == 1 else "")
        print(f"{threads} thread(s): fp32 AdamW {fp32 / 1e9:.3f} Gparam/s, bf16 state {bf16 / 1e9:.3f} Gparam/s, "
              f"{bf16 / fp32:.2f}x{cpu} (load {load:.2f} -> {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
