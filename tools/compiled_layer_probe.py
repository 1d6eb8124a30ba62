"""One dense decoder layer timed eager against compiled, for ``megatrain-plan profile --compiled-layers``
(planner/profiling/compiled_speedup.py runs this module in its own process: the planner never imports the runtime,
whose layer path this is).

``python -m megatrain.tools.compiled_layer_probe [--device cuda] [--dtype bfloat16] [--shape 8b]`` prints one JSON
line: the seconds of one micro-batch's work on one layer as a training step does it (the forward without autograd,
then the recompute with autograd and its backward: runtime/model/layer_backward.py), through the runtime's
``LayerRunner`` eager and compiled ([Note: compiled layers]), alternated ``--pairs`` times after the compile, the
fastest of each; their ratio (``speedup``: eager / compiled); the compile's seconds; and the SDPA operators each
path ran (read from torch.profiler: compiling must leave attention to the same kernel, ``same_attention``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

import torch

from megatrain.runtime.config import ModelConfig
from megatrain.runtime.model.compiled_layers import LayerRunner, compile_backend
from megatrain.runtime.model.layer_backward import recompute_backward
from megatrain.runtime.model.rotary_positions import RotaryPositions
from megatrain.runtime.model.templates import Templates

# Layer shapes: Llama-3.1-8B's decoder layer at one micro-batch of the flagship's 4096-token rows (the profile's
# representative shape), and a tiny one for a CPU's check.
SHAPES: dict[str, dict[str, int]] = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, rows=4,
               seq=4096),
    "tiny": dict(hidden_size=32, intermediate_size=56, num_attention_heads=4, num_key_value_heads=2, rows=2, seq=12),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _attention_ops(fn: Callable[[], None]) -> list[str]:
    """The SDPA backend operators one call of ``fn`` runs (forward and backward), by torch.profiler's names."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sorted({e.name for e in prof.events() if "_scaled_dot_product_" in e.name})


def measure(shape: str, device: str, dtype: str, backend: str | None = None, pairs: int = 10) -> dict[str, Any]:
    """The probe's figures (see the module's docstring) for layer ``shape`` in ``dtype`` on ``device``."""
    dims = dict(SHAPES[shape])
    rows, seq = dims.pop("rows"), dims.pop("seq")
    config = ModelConfig(vocab_size=128, num_hidden_layers=1, **dims)
    dev, dt = torch.device(device), DTYPES[dtype]
    templates = Templates(config, lambda name: True)
    layer = templates.layers[0]
    gen = torch.Generator(device="cpu").manual_seed(0)
    flat = (torch.randn(layer.layout.numel, generator=gen) * 0.02).to(dev, dt)
    params = layer.layout.views(flat)
    x = torch.randn(rows, seq, config.hidden_size, generator=gen).to(dev, dt)
    dy = torch.randn(rows, seq, config.hidden_size, generator=gen).to(dev, dt) * 1e-3
    (positions,) = RotaryPositions(config, dev).positions(seq, [slice(None)], None, None)[None]
    runners = {"eager": LayerRunner(templates, False), "compiled": LayerRunner(templates, True, backend)}

    def work(name: str) -> Callable[[], None]:
        run = runners[name]

        def once() -> None:
            with torch.no_grad():
                run(layer, params, x, *positions)
            recompute_backward(run, layer, params, x, dy, positions, lambda grads: None, 0, 0)
        return once

    def timed(fn: Callable[[], None]) -> float:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    compile_s = timed(work("compiled"))  # builds the forward's and the recompute's graphs
    timed(work("eager"))
    eager, compiled = [], []
    for _ in range(pairs):
        eager.append(timed(work("eager")))
        compiled.append(timed(work("compiled")))
    ops = {name: _attention_ops(work(name)) for name in runners}
    return {"shape": shape, "device": str(dev), "dtype": dtype, "tokens": rows * seq,
            "backend": runners["compiled"].backend, "eager_s": min(eager), "compiled_s": min(compiled),
            "speedup": min(eager) / min(compiled), "compile_s": compile_s, "attention_ops": ops,
            "same_attention": bool(ops["eager"]) and ops["eager"] == ops["compiled"],
            "compiled_calls": runners["compiled"].compiled_calls}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatrain.tools.compiled_layer_probe",
                                description="one decoder layer's step work, eager against torch.compile")
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--backend", default=None, help=f"torch.compile's backend (default: {compile_backend()})")
    p.add_argument("--pairs", type=int, default=10)
    args = p.parse_args(argv)
    print(json.dumps(measure(args.shape, args.device, args.dtype, args.backend, max(1, args.pairs))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
