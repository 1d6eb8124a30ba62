"""DeepSpeed ZeRO-3 with parameters and optimizer offloaded to pinned CPU memory: the usual offload recipe.

The comparison runs it at micro-batches of 4, 8 and 16 (those that divide the batch; ``sweep.DEEPSPEED_MICRO_BATCHES``):
ZeRO-3 gathers every parameter once per micro-batch, so a larger one does less of that per token; the best is
the headline, every one is kept in the JSON. ``run_zero_offload.py`` runs stage 2 (ZeRO-Offload) with this code.

bf16 compute, ``DeepSpeedCPUAdam`` (AdamW mode; DeepSpeed picks it for an "AdamW" optimizer
when the optimizer is offloaded, and JIT-builds it with ninja and nvcc on first use),
gradient clipping and accumulation by DeepSpeed, and per-layer activation checkpointing
through transformers. Bucket sizes are the values Hugging Face's "auto" fills in from the
hidden size. CUDA only: a CPU run records it as not run.
"""
from __future__ import annotations

from typing import Any

import torch

from .spec import NotRun, RunSpec
from .trainer import TorchTrainer
from .weights import build_hf_model, distinct_parameters


def ds_config(spec: RunSpec, stage: int = 3) -> dict[str, Any]:
    """ZeRO-3: parameters and optimizer state offloaded to pinned host memory. ZeRO-2 (ZeRO-Offload): bf16
    parameters and gradients on the device, fp32 masters and AdamW state offloaded to pinned host memory."""
    hidden = spec.config["hidden_size"]
    zero: dict[str, Any] = {
        "stage": stage,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": hidden * hidden,
    }
    if stage == 3:
        zero.update({"offload_param": {"device": "cpu", "pin_memory": True},
                     "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                     "stage3_param_persistence_threshold": 10 * hidden})
    else:
        zero.update({"allgather_bucket_size": hidden * hidden, "reduce_scatter": True})
    return {
        "train_batch_size": spec.batch,
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": spec.micro_batches,
        "gradient_clipping": spec.max_grad_norm,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": spec.lr, "betas": list(spec.betas), "eps": spec.eps,
                                                  "weight_decay": spec.weight_decay}},
        "zero_optimization": zero,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class DeepspeedTrainer(TorchTrainer):
    def __init__(self, spec: RunSpec, stage: int = 3) -> None:
        if spec.device != "cuda":
            raise NotRun("needs CUDA")
        try:
            import deepspeed
        except ImportError as e:
            raise NotRun(f"not installed ({e}); pip install deepspeed (offline: wheels from "
                         f"pip download deepspeed --no-deps -d .whl, then pip install .whl/*.whl)") from None
        self.spec = spec
        torch.cuda.set_device(0)
        self.device = torch.device("cuda", 0)
        deepspeed.init_distributed(dist_backend="nccl")
        model = build_hf_model(spec, "cpu")  # ZeRO partitions it (ZeRO-3: into pinned host memory) on initialize
        self.params = distinct_parameters(model)
        config = ds_config(spec, stage)
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        basic = getattr(self.engine, "basic_optimizer", None)
        self.details = {"deepspeed": deepspeed.__version__, "config": config, "zero_stage": stage,
                        "micro_batch": spec.micro_batch,
                        "optimizer": type(basic).__name__ if basic is not None else "unknown",
                        "activation_checkpointing": "per layer (transformers, non-reentrant)"}

    def step(self, ids: torch.Tensor) -> float:
        ids = ids.to(self.engine.device, non_blocking=True)
        total = torch.zeros((), device=self.engine.device)
        for micro in ids.split(self.spec.micro_batch):
            loss = self.engine(input_ids=micro, labels=micro, use_cache=False).loss
            self.engine.backward(loss)  # scaled by 1 / gradient_accumulation_steps inside
            self.engine.step()          # the optimizer step runs at the accumulation boundary only
            total += loss.detach().float()
        return (total / self.spec.micro_batches).item()

    def close(self) -> None:
        destroy = getattr(self.engine, "destroy", None)
        if destroy is not None:
            destroy()


def build(spec: RunSpec) -> DeepspeedTrainer:
    return DeepspeedTrainer(spec)
