"""megatrain against the systems users would pick instead, side by side in one run.

    python benchmarks/peers.py --model tiny --seq 32 --batch 4 --micro-batch 2 --steps 3    # a CPU check
    python benchmarks/peers.py --model 1b --seq 2048 --batch 16 --micro-batch 4 --steps 4    # one case on a GPU
    python benchmarks/peers.py --sweep                # on a GPU: 1b, 3b x seq 2048, 8192, then grow (540 s)
    python benchmarks/peers.py --sweep --resume       # go on with today's sweep where its budget ended

Systems, each in a fresh subprocess (peak memory is its own), from the same initial
weights and token batches, with the same global batch, sequence length, clipping
(max_grad_norm 1.0) and AdamW hyper-parameters (lr 3e-4 unless --lr, betas 0.9/0.95, eps 1e-8,
weight decay 0.1 on every parameter):

  megatrain  the planner's plan; bf16 compute on CUDA, fp32 on a CPU
  pytorch    transformers' Llama in device memory: fp32 master, bf16 autocast (CUDA),
             per-layer activation checkpointing, fused AdamW on the device
  fsdp2      fully_shard at world size 1: CPUOffloadPolicy + bf16 MixedPrecisionPolicy and
             fused CPU AdamW on CUDA; plain fp32 sharding on a CPU (nothing to offload to)
  deepspeed  ZeRO-3, parameters and optimizer offloaded to pinned CPU memory,
             DeepSpeedCPUAdam, bf16 (CUDA only; `pip install deepspeed`, or
             offline: `pip wheel --no-deps -w .whl deepspeed`, see gpu_session.sh, and install from .whl/)

Per system: status (ok / out of memory with its peak / failed / not run), median step
time after the warm-up, tokens/s, model TFLOP/s (6 x N x tokens / step time; recompute
and attention not counted; attention TFLOP/s apart), MFU against a matmul peak measured
at the start of the run, peak GPU memory, peak host RSS, host memory used (pinned
included), the loss of every step and the final loss's difference from PyTorch's.
megatrain's per-step time breakdown when its engine gives one. Writes
benchmarks/results/<date>_<device>_peers.{json,md} and a PNG of tokens/s against model
size (when matplotlib is importable). The parts are in benchmarks/peer_runners/.
"""
from __future__ import annotations

import sys

from peer_runners.cli import main  # the package benchmarks/peer_runners/, beside this file

if __name__ == "__main__":
    sys.exit(main(__doc__))
