"""What fits in device memory, estimated from the model's shape: each peer's most economical-of-time setting.

Each peer runs at its best where it fits, and the estimate decides what to try (a try that runs out of memory
costs minutes on a large model); the PyTorch peer also falls back when its try runs out anyway. Estimates, in
bytes, for a model of N parameters (``shape.params``) trained on micro-batches of ``micro x seq`` tokens:

  in-VRAM PyTorch     16 N (fp32 weights, fp32 gradients, AdamW m and v) + 2 N (autocast's bf16 weight copies)
                      + activations: without checkpointing L x tokens x ``layer_working_bytes_per_token`` (bf16),
                      with per-layer checkpointing L x tokens x hidden x 2 + one layer's working set;
                      + tokens x ``logits_bytes_per_token`` (the loss)
  ZeRO-Offload (2)    4 N (bf16 weights and gradients on the device; fp32 masters and AdamW state on the host)
                      + the activations with per-layer checkpointing, as above
  FSDP2 no-sync       4 N (gradients accumulated unsharded in fp32 across micro-batches, world size 1)
                      + the activations with per-layer checkpointing + one layer's bf16 weights

A setting is tried when its estimate is at most ``FIT_FRACTION`` of the device's memory (allocator
fragmentation, CUDA context, the transformers model's own buffers are not in the estimate).
"""
from __future__ import annotations

from typing import Any

FIT_FRACTION = 0.85
GIB = 2**30


def activation_bytes(shape: Any, tokens: int, checkpointing: bool) -> int:
    """Activations of one micro-batch of ``tokens`` tokens at its peak (backward), bf16."""
    layer = shape.layer_working_bytes_per_token("bf16") * tokens
    loss = shape.logits_bytes_per_token("bf16") * tokens
    if checkpointing:
        return shape.num_layers * tokens * shape.checkpoint_bytes_per_token("bf16") + layer + loss
    return shape.num_layers * layer + loss


def in_vram_bytes(shape: Any, tokens: int, checkpointing: bool) -> int:
    """The in-VRAM PyTorch peer's device memory (fp32 weights, gradients and AdamW state, bf16 autocast)."""
    return 18 * shape.params + activation_bytes(shape, tokens, checkpointing)


def zero_offload_bytes(shape: Any, tokens: int) -> int:
    """ZeRO-Offload's (stage 2, optimizer on the host) device memory: bf16 weights and gradients, activations."""
    return 4 * shape.params + activation_bytes(shape, tokens, checkpointing=True)


def fsdp_no_sync_bytes(shape: Any, tokens: int) -> int:
    """FSDP2 with gradients accumulated unsharded on the device across micro-batches (world size 1)."""
    layer_weights = 2 * shape.params_layer
    return 4 * shape.params + layer_weights + activation_bytes(shape, tokens, checkpointing=True)


def fits(nbytes: int, device_bytes: int | None) -> bool:
    """Whether an estimate fits ``device_bytes`` (None: unknown, taken to fit; the run finds out)."""
    return device_bytes is None or nbytes <= FIT_FRACTION * device_bytes


def choose_checkpointing(shape: Any, tokens: int, device_bytes: int | None) -> tuple[bool, str]:
    """(checkpointing on?, why) for the in-VRAM PyTorch peer: off where the model fits without it."""
    without = in_vram_bytes(shape, tokens, checkpointing=False)
    of = "unknown memory" if device_bytes is None else f"{device_bytes / GIB:.1f} GiB"
    if fits(without, device_bytes):
        return False, f"off (estimate without it {without / GIB:.1f} GiB of {of})"
    return True, (f"per layer (non-reentrant): without it the estimate is {without / GIB:.1f} GiB of {of}, "
                  f"with it {in_vram_bytes(shape, tokens, True) / GIB:.1f} GiB")


def describe(nbytes: int, device_bytes: int | None) -> str:
    of = "unknown memory" if device_bytes is None else f"{device_bytes / GIB:.1f} GiB"
    return f"estimate {nbytes / GIB:.1f} GiB of {of}"
