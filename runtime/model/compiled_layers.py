"""A decoder layer's forward run eagerly or through ``torch.compile`` (``Plan.compiled_layers``).

[Note: compiled layers]
A dense decoder layer is a few matmuls and attention among elementwise work: RMSNorms (an fp32 copy, a square, a
mean, a scale), RoPE (four products and two sums on q and k), SwiGLU (SiLU of gate, times up) and two residual
adds, each its own kernel reading and writing whole activations in eager PyTorch. With ``Plan.compiled_layers``
the layer's forward (the template the executor runs for every layer of a type, ``Templates.run``: the forward,
the recompute before a backward and a kept layer's graph) goes through one ``torch.compile``d function, which
fuses that work into a few kernels (inductor by default) around the matmuls and attention, in forward and, through
AOTAutograd, in backward. The embedding and the head (its chunked cross-entropy) stay eager.

One compiled function per engine serves every layer: the templates are stateless and a layer's weights come in
as arguments (views of the slot the block is resident in, or of the host arena when computing in place), so the
graph does not depend on which layer runs, only on the layer's type and the shapes. It compiles once per
distinct (layer type, grad mode, shapes), in the first step: the forward's layers (no grad) are one graph, a
kept layer's forward and a recompute (grad) another; ``dynamic=False``, so a short last micro-batch (the batch
not a multiple of the micro-batch) compiles its own two graphs in the first step too, and an evaluation or
logits call of another batch or length its own once; kernels stay specialised to the step's shapes. Dynamo keeps
the graphs with the function's code and checks the layer's configuration, not which template object runs: a
later engine of the same layer shapes in the process reuses them. They are few, under the raised recompile
limit (``RECOMPILE_LIMIT``; dynamo's default of 8 counts every graph of this one function: two layer types, two
grad modes and two shapes are 8). On this project's 2-core CPU a tiny Llama layer's four graphs took about 60 s
to build with inductor (16 s with its cache of built kernels warm), 7 s with aot_eager.

Attention is the same kernel: ``scaled_dot_product_attention`` with the same ``sdpa_kernel`` restriction (flash
on CUDA in 16 bits) is traced as the SDPA operator, which inductor calls as it is, never decomposed
(tests/test_compiled_layers.py checks the CPU's; ``python -m megatrain.tools.compiled_layer_probe`` reports the
operators a GPU runs). A micro-batch of packed documents runs the layer eagerly: its attention makes one call
per distinct document length, so a compiled graph would be specialised to that micro-batch's packing and
compiled again for the next.

Numerics: compiled code computes the same operations in another order (fused reductions, no rounding to the
compute dtype between fused elementwise operations where inductor keeps fp32), so a compiled step is not the
eager step's bits: within float rounding, as two honest trainings differing in summation order are
(tests/numerics.py; a tiny Llama's two fp32 steps with inductor on a CPU: the same losses, weights within 1.9e-5
at lr 1e-2; with aot_eager, which runs the traced operators with eager kernels, the same bits). Only the plan field
switches it; the default stays eager, whose bits the equivalence tests hold.

Backend: ``torch.compile``'s default (inductor; on a CPU it needs a C++ compiler) unless ``MEGATRAIN_COMPILE_BACKEND``
names another registered one ("aot_eager": AOTAutograd's graphs run by eager kernels, no code generated; what the
fast tests use). The environment, not the plan: which compiler builds the kernels is this process's matter, not
the planner's.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call

from megatrain.runtime.model.templates import Block, Templates

BACKEND_VARIABLE = "MEGATRAIN_COMPILE_BACKEND"
DEFAULT_BACKEND = "inductor"
# Graphs one compiled function may hold before dynamo runs new shapes eagerly (its default: 8).
RECOMPILE_LIMIT = 64
# A layer's forward arguments after x, cos and sin, as its defaults: documents, mlp_tile_tokens, part,
# attention_tile_tokens (models/layers/decoder.py).
_DEFAULTS: tuple = (None, 0, "layer", 0)


def compile_backend() -> str:
    """The backend ``torch.compile`` builds compiled layers with: ``MEGATRAIN_COMPILE_BACKEND``, else inductor."""
    return os.environ.get(BACKEND_VARIABLE) or DEFAULT_BACKEND


def _layer_forward(module: nn.Module, params: dict[str, torch.Tensor], args: tuple) -> torch.Tensor:
    """The template ``module`` with ``params`` bound, on ``args``: what ``torch.compile`` traces."""
    return functional_call(module, params, args, strict=True)


class LayerRunner:
    """How the executor runs a decoder layer's template: ``Templates.run``, or compiled ([Note: compiled layers])."""

    def __init__(self, templates: Templates, compiled: bool, backend: str | None = None) -> None:
        self.templates = templates
        self.backend = (backend or compile_backend()) if compiled else None
        self._compiled: Callable[..., torch.Tensor] | None = (
            torch.compile(_layer_forward, backend=self.backend, dynamic=False) if compiled else None)
        self.compiled_calls = 0  # calls that went through the compiled function

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def bound(self, layer: Block, params: dict[str, torch.Tensor]) -> contextlib.AbstractContextManager[nn.Module]:
        """The template of ``layer`` with ``params`` bound for many calls (``Templates.bound``): a tiled backward's
        parts, which run eagerly."""
        return self.templates.bound(layer, params)

    def __call__(self, layer: Block, params: dict[str, torch.Tensor], *args: Any) -> torch.Tensor:
        """``Templates.run(layer, params, *args)``: args as a layer's forward takes them (x, cos, sin, documents,
        mlp_tile_tokens, part, attention_tile_tokens). Compiled where the plan says so, for a whole layer's forward
        without packed documents; the parts of a tiled backward and packed micro-batches eagerly."""
        full = args + _DEFAULTS[len(args) - 3:]  # one graph for a forward and a recompute of the same grad mode
        if self._compiled is None or full[3] is not None or full[5] != "layer":
            return self.templates.run(layer, params, *args)
        self.compiled_calls += 1
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return self._compiled(self.templates.module(layer), params, full)
