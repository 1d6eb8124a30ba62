"""How much faster a dense decoder layer runs through torch.compile than eagerly, for ``megatrain-plan profile
--compiled-layers``: the profile's ``compiled_layer_speedup``, which the cost model applies to a plan with
``Plan.compiled_layers`` and the search offers such plans by.

Measured by the runtime's own layer path in a child process (``python -m megatrain.tools.compiled_layer_probe``:
the planner never imports the runtime): one Llama-3.1-8B decoder layer at 4 x 4096 tokens, its forward, recompute
and backward as a step runs them, eager against compiled, alternated. A speedup is kept only where the compiled
layer ran the same attention operators as the eager one (the runtime's promise: compiling fuses the elementwise
work, never changes attention). Pure stdlib.
"""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Callable

# A GPU's compile of the 8B layer's graphs and 2 x 11 timed passes take one to two minutes; past this, not measured.
PROBE_TIMEOUT_S = 420


def measure(device: str, dtype: str, log: Callable[[str], None],
            shape: str = "8b", backend: str | None = None) -> tuple[dict[str, float], str | None]:
    """({dtype: eager / compiled seconds}, None), or ({}, why it was not measured) where the probe failed or
    compiling changed the attention operators."""
    cmd = [sys.executable, "-m", "megatrain.tools.compiled_layer_probe", "--device", device, "--dtype", dtype,
           "--shape", shape, *(["--backend", backend] if backend else [])]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        return {}, f"compiled layers not measured ({type(e).__name__})"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {}, f"compiled layers not measured (the probe failed: {last[:200]})"
    try:
        got = json.loads(done.stdout.strip().splitlines()[-1])
        speedup, same = float(got["speedup"]), bool(got["same_attention"])
    except (ValueError, IndexError, KeyError, TypeError):
        return {}, "compiled layers not measured (the probe's output was not its JSON line)"
    log(f"a decoder layer compiled: {speedup:.3f}x eager ({got.get('compile_s', 0.0):.0f} s to compile); "
        f"attention {got.get('attention_ops')}")
    if not same:
        return {}, f"compiled layers not kept: they ran other attention operators ({got.get('attention_ops')})"
    if not speedup > 0:
        return {}, f"compiled layers not kept: speedup {speedup!r}"
    return {dtype: speedup}, None
