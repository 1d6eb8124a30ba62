"""The same initial weights in every system, and the Hugging Face Llama the peers train.

Each weight is drawn on its own from a generator seeded by (seed, its Hugging Face name):
normal(0, initializer_range) for matrices, ones for norms. Nothing depends on the order in
which a system builds its modules, so megatrain (host masters, loaded tensor by tensor),
the in-memory model, FSDP2 and DeepSpeed start from the same numbers without a weights
file. Draws are made on the run's device (CUDA's generator is deterministic too), so a
CUDA run and a CPU run start from different, equally random, weights.

[Note: no weights file] A 7B model's fp32 weights are 28 GB; writing and reading them
once per system would cost minutes and disk. Drawing each tensor where it is needed costs
one tensor of memory at a time and well under a second per billion parameters on a GPU.
"""
from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .spec import RunSpec


def initial_weight(name: str, shape: tuple[int, ...], spec: RunSpec) -> torch.Tensor:
    """The initial value of parameter ``name`` (a Hugging Face name), fp32, on ``spec.device``."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=spec.device)
    if name.endswith(".bias"):
        return torch.zeros(shape, device=spec.device)
    gen = torch.Generator(device=spec.device).manual_seed(spec.seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape, device=spec.device).normal_(0.0, spec.config["initializer_range"], generator=gen)


class InitialWeights(Mapping):
    """A state dict whose tensors are drawn when read (``initial_weight``): one tensor in memory at a time.

    Keys are the model's distinct parameter names (a tied lm_head is the embedding's, so it is absent).
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], spec: RunSpec) -> None:
        self.shapes = dict(shapes)
        self.spec = spec

    def __getitem__(self, name: str) -> torch.Tensor:
        return initial_weight(name, self.shapes[name], self.spec)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def hf_config(spec: RunSpec):
    from transformers import LlamaConfig

    return LlamaConfig(**spec.config)


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """Skip transformers' own random init (every weight is overwritten): its home moved in 5.x."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        yield


def build_hf_model(spec: RunSpec, device: str | torch.device, checkpointing: bool = True) -> Any:
    """transformers' LlamaForCausalLM in fp32 on ``device`` with the initial weights, in training mode; per-layer
    activation checkpointing (non-reentrant) on unless ``checkpointing`` is False."""
    from transformers import LlamaForCausalLM

    with torch.device(device), _no_init():
        model = LlamaForCausalLM(hf_config(spec))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(initial_weight(name, tuple(p.shape), spec))
    if checkpointing:
        enable_checkpointing(model)
    model.train()
    return model


def enable_checkpointing(model: Any) -> None:
    """Per-layer activation checkpointing (non-reentrant) on a transformers model."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the older name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()


def model_shape(spec: RunSpec) -> Any:
    """The planner's ModelShape of the run's model (what the memory estimates of ``fits`` read)."""
    from .run_megatrain import import_megatrain

    import_megatrain()
    from megatrain.planner.shapes import model_shapes

    return model_shapes.from_config(spec.config)


def device_bytes(spec: RunSpec) -> int | None:
    """The memory a peer's device holds: the GPU's total on CUDA, the host's available memory on a CPU."""
    if spec.device == "cuda":
        return int(torch.cuda.get_device_properties(0).total_memory)
    from .memory import host_available

    return host_available()


def distinct_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
