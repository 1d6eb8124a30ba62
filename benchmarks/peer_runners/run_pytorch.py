"""Plain PyTorch with the whole model on the device: what fits in GPU memory, done the usual way, at its best.

transformers' Llama with fp32 master weights on the device, bf16 autocast on CUDA (none on
a CPU), gradient accumulation over the micro-batches, ``clip_grad_norm_`` and
``torch.optim.AdamW(fused=True)`` on the device. Activation checkpointing only where it must:
off when the memory estimate without it fits (``fits.choose_checkpointing``); if a step still
runs out of device memory without it, per-layer checkpointing is switched on and the step run
again (the details record which ran, and why).
"""
from __future__ import annotations

import contextlib

import torch

from . import fits
from .spec import RunSpec
from .trainer import TorchTrainer
from .weights import build_hf_model, device_bytes, distinct_parameters, enable_checkpointing, model_shape


def _autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext()


def accumulate(model: torch.nn.Module, ids: torch.Tensor, spec: RunSpec, autocast) -> torch.Tensor:
    """Forward and backward over the micro-batches of ``ids`` [batch, seq]; returns the step's mean loss
    (a device scalar). Every micro-batch holds as many tokens, so the mean of their means is the mean."""
    total = torch.zeros((), device=ids.device)
    for micro in ids.split(spec.micro_batch):
        with autocast:
            loss = model(input_ids=micro, labels=micro, use_cache=False).loss
        (loss / spec.micro_batches).backward()
        total += loss.detach()
    return total / spec.micro_batches


class PytorchTrainer(TorchTrainer):
    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.device = torch.device(spec.device)
        self.checkpointing, why = fits.choose_checkpointing(model_shape(spec), spec.micro_batch * spec.seq,
                                                            device_bytes(spec))
        self.model = build_hf_model(spec, self.device, checkpointing=self.checkpointing)
        self.params = distinct_parameters(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                           weight_decay=spec.weight_decay, fused=True)
        self.autocast = _autocast(spec.device)
        self.steps = 0
        self.details = {"compute_dtype": "bf16 autocast" if spec.device == "cuda" else "fp32",
                        "weights": f"fp32 on {spec.device}", "activation_checkpointing": why,
                        "optimizer": f"torch.optim.AdamW(fused=True) on {spec.device}"}

    def step(self, ids: torch.Tensor) -> float:
        ids = ids.to(self.device, non_blocking=True)
        self.steps += 1
        try:
            loss = accumulate(self.model, ids, self.spec, self.autocast)
        except torch.OutOfMemoryError:
            if self.checkpointing:
                raise
            loss = None  # retried below, outside the handler: the exception's frames hold the activations
        if loss is None:
            # Forward and backward only ran out (the optimizer has not stepped): the weights are as they were.
            self.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            enable_checkpointing(self.model)
            self.checkpointing = True
            self.details["activation_checkpointing"] = (f"per layer (non-reentrant): without it step {self.steps} "
                                                        f"ran out of device memory; that step ran again with it")
            loss = accumulate(self.model, ids, self.spec, self.autocast)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()  # waits for the optimizer too: it is queued before the copy on the same stream

    def pinned_bytes(self) -> int | None:
        return 0

    def close(self) -> None:
        del self.optimizer, self.model


def build(spec: RunSpec) -> PytorchTrainer:
    return PytorchTrainer(spec)
