"""The head's loss: final norm, lm_head and cross-entropy, forward and backward at once, in chunks.

The full [tokens, vocab] logits never exist: ``chunk`` tokens at a time, the
logits are computed, the loss summed, and their gradient taken immediately
(w.r.t. the normed hidden states and lm_head's weight); then the norm's
backward gives the gradient w.r.t. the head's input. Peak extra memory:
chunk x vocab x (compute bytes + 12): the logits, the fp32 log-probabilities cross-entropy keeps, and in
backward the fp32 gradients of both.

Labels follow Hugging Face: same shape as input_ids, shifted inside (position
t predicts labels[t + 1]), -100 ignored. Each micro-batch's loss is its summed
token losses divided by ``n_tokens``, the number of predicted tokens in the
whole batch, so the micro-batch losses (and gradients) add up to the batch mean.

``softcap`` (``ModelConfig.final_logit_softcapping``, Gemma 3): each chunk's logits become c x tanh(logits / c)
before the loss, in the compute dtype, as transformers caps them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """labels: [B, S] int64 -> [B, S]: position t holds labels[t + 1]; the last holds -100."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]


@dataclass
class HeadGrads:
    loss: torch.Tensor  # [] fp32: this micro-batch's share of the batch mean
    dx: torch.Tensor  # [b, S, hidden]: gradient w.r.t. the head's input
    norm: dict[str, torch.Tensor]  # gradients of the norm's parameters, by local name


def head_forward_backward(
    norm: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor],
    norm_params: dict[str, torch.Tensor],
    lm_weight: torch.Tensor,
    x: torch.Tensor,
    labels: torch.Tensor,
    n_tokens: torch.Tensor,
    chunk: int,
    lm_grad: torch.Tensor,
    correct: torch.Tensor | None = None,
    softcap: float | None = None,
) -> HeadGrads:
    """norm(params, x) -> normed; lm_weight: [vocab, hidden]; x: [b, S, hidden]; labels: [b, S] shifted.

    Each chunk's lm_head gradient is added straight into ``lm_grad`` ([vocab, hidden] fp32), so
    chunk gradients never sum in the compute dtype. ``correct`` ([] int64, on the device), when given, is
    added each chunk's count of predicted tokens whose argmax is their label (``count_correct``).
    """
    x = x.detach().requires_grad_()
    leaves = {k: v.detach().requires_grad_() for k, v in norm_params.items()}
    weight = lm_weight.detach().requires_grad_()
    with torch.enable_grad():
        normed = norm(leaves, x)
    flat = normed.detach().reshape(-1, normed.shape[-1])  # [T, hidden]
    d_flat = torch.empty_like(flat)

    def chunk_loss(rows: slice, chunk_labels: torch.Tensor) -> torch.Tensor:
        h = flat[rows].detach().requires_grad_()
        with torch.enable_grad():
            logits = soft_cap(F.linear(h, weight), softcap)  # [c, vocab]
            part = _cross_entropy(logits, chunk_labels, n_tokens)
        if correct is not None:
            count_correct(correct, logits.detach(), chunk_labels)
        d_h, d_w = torch.autograd.grad(part, (h, weight))
        d_flat[rows] = d_h
        lm_grad.add_(d_w)
        return part.detach()

    loss = _chunked_loss(flat.shape[0], labels, chunk, chunk_loss)
    grads = torch.autograd.grad(normed, (x, *leaves.values()), d_flat.view_as(normed))
    return HeadGrads(loss, grads[0], dict(zip(leaves.keys(), grads[1:])))


def head_loss(
    norm: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor],
    norm_params: dict[str, torch.Tensor],
    lm_weight: torch.Tensor,
    x: torch.Tensor,
    labels: torch.Tensor,
    n_tokens: torch.Tensor,
    chunk: int,
    correct: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The loss of ``head_forward_backward`` alone (evaluation): the same chunk loop and operations, so the
    value is the same bits; no gradient, and still never the full logits."""
    flat = norm(norm_params, x).reshape(-1, x.shape[-1])  # [T, hidden]

    def chunk_loss(rows: slice, chunk_labels: torch.Tensor) -> torch.Tensor:
        logits = soft_cap(F.linear(flat[rows], lm_weight), softcap)  # [c, vocab]
        if correct is not None:
            count_correct(correct, logits, chunk_labels)
        return _cross_entropy(logits, chunk_labels, n_tokens)

    return _chunked_loss(flat.shape[0], labels, chunk, chunk_loss)


def _chunked_loss(tokens: int, labels: torch.Tensor, chunk: int,
                  chunk_loss: Callable[[slice, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The one chunk loop: ``chunk_loss(rows, labels of rows)`` for each ``chunk`` tokens of the ``tokens``
    in order, summed in float64 (one chunk gives back the float32 value exactly); returns [] fp32."""
    flat_labels = labels.reshape(-1)
    loss: torch.Tensor | None = None
    for start in range(0, tokens, chunk):
        rows = slice(start, min(start + chunk, tokens))
        part = chunk_loss(rows, flat_labels[rows]).double()
        loss = part if loss is None else loss + part
    assert loss is not None
    return loss.float()


def count_correct(correct: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
    """correct: [] int64 += how many of the chunk's predicted tokens have their label as argmax (no host sync;
    logits: [c, vocab], the chunk's own; labels: [c] shifted, -100 ignored)."""
    correct.add_(((logits.argmax(dim=-1) == labels) & (labels != IGNORE_INDEX)).sum())


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
    """logits: [c, vocab]; labels: [c] -> this chunk's summed token losses over the batch's ``n_tokens`` ([] fp32)."""
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum") / n_tokens


def chunked_logits(flat: torch.Tensor, weight: torch.Tensor, chunk: int,
                   softcap: float | None = None) -> torch.Tensor:
    """flat: [T, hidden] -> [T, vocab] (evaluation only: materialises the logits the caller asked for)."""
    return torch.cat([soft_cap(F.linear(flat[s:s + chunk], weight), softcap) for s in range(0, flat.shape[0], chunk)])


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """logits [c, vocab] capped to cap x tanh(logits / cap) (transformers' final logit soft-capping); None: as
    they are."""
    return logits if cap is None else torch.tanh(logits / cap) * cap
