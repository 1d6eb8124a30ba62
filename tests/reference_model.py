"""Ordinary PyTorch training of the same model: the reference megatrain must equal.

The model is built from megatrain's own block classes (their agreement with
Hugging Face transformers is tested separately), with real parameters, one
autograd graph over the whole model, the full [tokens, vocab] logits, and
``torch.optim.AdamW(fused=True)`` + ``clip_grad_norm_``: no streaming, no
recompute, no chunking, no flat buffers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from megatrain.runtime import ModelConfig, OptimizerConfig
from megatrain.models.layers.decoder import DecoderLayer, RMSNorm
from megatrain.runtime.model.head_loss import IGNORE_INDEX, shift_labels
from megatrain.models.layers.rope import attention_scaling, inverse_frequencies, rotary_tables


class _Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class ReferenceLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, checkpoint: bool = False) -> torch.Tensor:
        """[B, S] -> logits [B, S, vocab]; ``checkpoint`` recomputes each layer in backward (benchmarks)."""
        x = self.model.embed_tokens(input_ids)
        seq = input_ids.shape[1]
        cos, sin = rotary_tables(inverse_frequencies(self.config, seq), seq, x.device, attention_scaling(self.config))
        for layer in self.model.layers:
            if checkpoint:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


def make_optimizer(model: ReferenceLM, opt: OptimizerConfig) -> torch.optim.AdamW:
    named = list(model.named_parameters())
    decay = [p for n, p in named if opt.decays(n)]
    no_decay = [p for n, p in named if not opt.decays(n)]
    groups = [g for g in ({"params": decay, "weight_decay": opt.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    return torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps, fused=True)


def reference_step(model: ReferenceLM, optim: torch.optim.AdamW, input_ids: torch.Tensor, labels: torch.Tensor,
                   micro_batch_size: int, max_grad_norm: float | None, lr: float,
                   master: ReferenceLM | None = None) -> torch.Tensor:
    """Gradient accumulation over the same micro-batches, in the same order, then clip and AdamW.

    ``master``: for a model on the GPU, its fp32 twin in host memory that ``optim`` steps (torch's
    fused CPU AdamW, as megatrain's host optimizer); the GPU model's gradients go to it after
    clipping, and its updated parameters come back."""
    shifted = shift_labels(labels)
    n_tokens = (shifted != IGNORE_INDEX).sum()
    total = torch.zeros(())
    for s in range(0, input_ids.shape[0], micro_batch_size):
        rows = slice(s, s + micro_batch_size)
        logits = model(input_ids[rows])
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32, or float64 for a float64 model
        loss = F.cross_entropy(wide.reshape(-1, logits.shape[-1]), shifted[rows].reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum") / n_tokens
        loss.backward()
        total = total + loss.detach()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    for group in optim.param_groups:
        group["lr"] = lr
    if master is not None:
        for p, host in zip(model.parameters(), master.parameters()):
            host.grad = p.grad.detach().cpu()
    optim.step()
    optim.zero_grad(set_to_none=True)
    if master is not None:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, host in zip(model.parameters(), master.parameters()):
                p.copy_(host)
    return total
