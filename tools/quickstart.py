"""A first run: train a small Llama-shaped model on text that ships with Python.

    python -m megatrain.tools.quickstart [--steps N]

Byte-level tokens from the standard library's ``pydoc_data`` topics, a ~1M-parameter
model streamed block by block through the runtime (GPU if there is one, else CPU).
It prints the loss as it falls and the throughput at the end. The full training
command (data, tokenizers, schedules, checkpoints, metrics) is ``megatrain-train``
(tools/train.py), whose no-argument run is the fuller demo.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from megatrain.runtime import Engine, MegatrainError, ModelConfig, OptimizerConfig


def corpus_bytes() -> torch.Tensor:
    from pydoc_data import topics

    text = "\n".join(topics.topics.values()).encode("utf-8")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (60)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (8)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (128)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch < 1 or args.seq < 2:
        print("megatrain: --steps and --batch must be >= 1 and --seq >= 2", file=sys.stderr)
        return 2

    data = corpus_bytes()
    config = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq)
    try:
        # bf16 where it is fast (the GPU); fp32 on a CPU, whose bf16 matmuls are slow.
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        engine = Engine(config, OptimizerConfig(lr=2e-3, weight_decay=0.1, max_grad_norm=1.0,
                                                no_decay=("norm", "bias")), compute_dtype=dtype)
    except MegatrainError as e:
        print(f"megatrain: {e}", file=sys.stderr)
        return 2
    print(f"{engine.num_parameters / 1e6:.2f}M parameters on {engine.device}, {len(data):,} bytes of text")
    gen = torch.Generator().manual_seed(0)
    start, first = time.perf_counter(), None
    with engine:
        for step in range(1, args.steps + 1):
            offsets = torch.randint(0, len(data) - args.seq, (args.batch,), generator=gen)
            ids = torch.stack([data[o:o + args.seq] for o in offsets.tolist()])
            loss = engine.step(ids, ids).item()
            first = loss if first is None else first
            if step == 1 or step % 10 == 0 or step == args.steps:
                print(f"step {step:4d}  loss {loss:.3f}")
        engine.synchronize()
    seconds = time.perf_counter() - start
    tokens = args.steps * args.batch * args.seq
    print(f"loss {first:.3f} -> {loss:.3f}; {tokens / seconds:,.0f} tokens/s over {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
