"""megatrain against the systems users would pick instead, each at its best, side by side in one run.

    python benchmarks/peers.py --model tiny --seq 32 --batch 4 --micro-batch 2 --steps 3    # a CPU check
    python benchmarks/peers.py --model 1b --seq 2048 --batch 16 --micro-batch 4             # one case on a GPU
    python benchmarks/peers.py --sweep                # on a GPU: 1b, 3b x seq 2048, 8192, then grow (900 s)
    python benchmarks/peers.py --sweep --resume       # go on with today's sweep where its budget ended

Systems, each in a fresh subprocess (peak memory is its own), from the same initial
weights and token batches, with the same global batch, sequence length, clipping
(max_grad_norm 1.0) and AdamW hyper-parameters (lr 3e-4 unless --lr, betas 0.9/0.95, eps 1e-8,
weight decay 0.1 on every parameter), following the protocol in benchmarks/README.md:

  megatrain     the planner's plan; bf16 compute on CUDA, fp32 on a CPU
  pytorch       transformers' Llama in device memory: fp32 master, bf16 autocast (CUDA),
                activation checkpointing only where the model does not fit without it
                (a memory estimate, and a fall-back when a step runs out), fused AdamW on the device
  fsdp2         fully_shard at world size 1 as its documentation configures it: layers then the
                root, reshard_after_forward True / False, CPUOffloadPolicy + bf16
                MixedPrecisionPolicy (fp32 reduce), fused CPU AdamW, gradients synced once per step
                where they fit; plain fp32 sharding on a CPU (nothing to offload to)
  deepspeed     ZeRO-3, parameters and optimizer offloaded to pinned CPU memory,
                DeepSpeedCPUAdam, bf16, at micro-batches 4, 8 and 16 (the best marked, every
                run kept) (CUDA only; `pip install deepspeed`, or offline: its wheels, see
                gpu_session.sh)
  zero_offload  DeepSpeed ZeRO-Offload: stage 2, optimizer offloaded, where the model fits the GPU

Per system: status (ok / out of memory with its peak / failed / not run), step time (median,
min and max of the timed steps after the warm-up; --steps 6 by default: 5 timed; one more step
runs untimed after them and the drain apart, so no timed step carries another's deferred work),
tokens/s, model TFLOP/s (6 x N_matmul x tokens / step time; recompute and attention not counted;
the every-parameter figure and attention TFLOP/s beside it), MFU against the matmul peak
measured at the start of the run and the datasheet's dense bf16 peak of the device, peak GPU
memory, peak host RSS, host memory used (pinned included), the loss of every step and the final
loss's difference from PyTorch's. megatrain's per-step time breakdown when its engine gives one.
Writes benchmarks/results/<date>_<device>_peers.{json,md} (every row with its own run's machine
header) and a PNG of tokens/s against model size (when matplotlib is importable). The parts are in
benchmarks/peer_runners/.
"""
from __future__ import annotations

import sys

from peer_runners.cli import main  # the package benchmarks/peer_runners/, beside this file

if __name__ == "__main__":
    sys.exit(main(__doc__))
