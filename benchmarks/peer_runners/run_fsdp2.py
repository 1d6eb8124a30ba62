"""PyTorch FSDP2 (``fully_shard``) at world size 1: on CUDA with CPU offload and bf16 mixed precision.

Configured as ``fully_shard``'s documentation recommends: called bottom-up, every decoder layer
(``reshard_after_forward=True``: its bf16 copy freed after forward, copied again for backward),
then the root (``reshard_after_forward=False``: the root is needed as soon as backward begins);
on CUDA with ``CPUOffloadPolicy(pin_memory=True)`` (fp32 parameters, gradients and AdamW state in
pinned host memory; each layer's parameters are copied to the GPU for its forward and
backward) and ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; the optimizer
is ``torch.optim.AdamW(fused=True)`` over the CPU shards (torch's fused CPU kernel). Gradient
accumulation without a sync per micro-batch (``set_requires_gradient_sync(False)`` but on the
last: no gradient copied to the host and added there per micro-batch) where the unsharded fp32
gradients fit on the device (``fits.fsdp_no_sync_bytes``); else every micro-batch syncs.
On a CPU there is nothing to offload to: the same sharding in fp32 with no offload policy
(the details record what ran). NCCL and gloo on CUDA, gloo on a CPU; the parent sets
MASTER_ADDR/MASTER_PORT.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import fits
from .spec import RunSpec
from .trainer import TorchTrainer
from .weights import build_hf_model, device_bytes, distinct_parameters, model_shape


class Fsdp2Trainer(TorchTrainer):
    def __init__(self, spec: RunSpec) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        self.spec = spec
        self.device = torch.device(spec.device)
        cuda = spec.device == "cuda"
        if cuda:
            torch.cuda.set_device(0)
        # CPU offload: the shards and their gradients are CPU tensors, so the norm reduction of clipping
        # runs on CPU tensors and needs gloo beside NCCL (torchtitan does the same).
        backend = "cuda:nccl,cpu:gloo" if cuda else "gloo"
        dist.init_process_group(backend, rank=0, world_size=1)
        mesh = init_device_mesh(spec.device, (1,))
        # Built in host memory: with CPU offload that is where the shards live; fully_shard moves each
        # parameter to the device, shards it and, offloading, copies the shard back to pinned host memory.
        model = build_hf_model(spec, "cpu")
        self.params = distinct_parameters(model)
        if cuda:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            offload = CPUOffloadPolicy(pin_memory=True)
        else:
            mp, offload = MixedPrecisionPolicy(), OffloadPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
        need, have = fits.fsdp_no_sync_bytes(model_shape(spec), spec.micro_batch * spec.seq), device_bytes(spec)
        self.no_sync = spec.micro_batches > 1 and fits.fits(need, have)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                           weight_decay=spec.weight_decay, fused=True)
        self.details = {
            "backend": backend,
            "offload": "CPUOffloadPolicy(pin_memory=True)" if cuda else "none (a CPU run has nothing to offload to)",
            "mixed_precision": "param bf16, reduce fp32" if cuda else "none (fp32)",
            "reshard_after_forward": "layers True, root False",
            "gradient_sync": (f"last micro-batch only ({fits.describe(need, have)})" if self.no_sync else
                              "every micro-batch" + ("" if spec.micro_batches == 1 else
                                                     f" (no-sync {fits.describe(need, have)}: does not fit)")),
            "activation_checkpointing": "per layer (non-reentrant)",
            "optimizer": "torch.optim.AdamW(fused=True) on the CPU shards",
        }

    def step(self, ids: torch.Tensor) -> float:
        ids = ids.to(self.device, non_blocking=True)
        total = torch.zeros((), device=ids.device)
        micros = ids.split(self.spec.micro_batch)
        for i, micro in enumerate(micros):
            if self.no_sync:  # reduce (and, offloading, copy to the host) the accumulated gradients once
                self.model.set_requires_gradient_sync(i == len(micros) - 1)
            loss = self.model(input_ids=micro, labels=micro, use_cache=False).loss  # bf16 comes from mp_policy
            (loss / self.spec.micro_batches).backward()
            total += loss.detach()
        loss = total / self.spec.micro_batches
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def close(self) -> None:
        del self.optimizer, self.model
        if dist.is_initialized():
            dist.destroy_process_group()


def build(spec: RunSpec) -> Fsdp2Trainer:
    return Fsdp2Trainer(spec)
