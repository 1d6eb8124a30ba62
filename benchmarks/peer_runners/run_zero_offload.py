"""DeepSpeed ZeRO-Offload: ZeRO stage 2 with the optimizer offloaded to pinned CPU memory, where the model fits.

What a 1-3B user with one GPU would pick: bf16 weights and gradients stay on the device (no
parameter gathers), fp32 masters and AdamW state live in host memory and ``DeepSpeedCPUAdam``
updates them. Run only where the device holds the model (``fits.zero_offload_bytes``); elsewhere
recorded as not run with the estimate. The rest as ``run_deepspeed.py`` (CUDA only).
"""
from __future__ import annotations

from . import fits
from .run_deepspeed import DeepspeedTrainer
from .spec import NotRun, RunSpec
from .weights import device_bytes, model_shape


def build(spec: RunSpec) -> DeepspeedTrainer:
    if spec.device != "cuda":
        raise NotRun("needs CUDA")
    need = fits.zero_offload_bytes(model_shape(spec), spec.micro_batch * spec.seq)
    have = device_bytes(spec)
    if not fits.fits(need, have):
        raise NotRun(f"the model does not fit the GPU for ZeRO-Offload ({fits.describe(need, have)})")
    trainer = DeepspeedTrainer(spec, stage=2)
    trainer.details["fits"] = fits.describe(need, have)
    return trainer
