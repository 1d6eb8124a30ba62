"""The routers of a step: per-expert token counts, and the load-balancing loss built block by block.

[Note: router balance]
transformers (``load_balancing_loss_func``, the same for Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss) takes every
layer's router logits z [T, E] of one forward call (gpt-oss's with its router's bias: what its router returns
first, which routes by the top-k of z itself, the same experts as the top-k of softmax(z)), p = softmax(z) in z's
dtype, each token's top-k experts of p, and

    f_e = (top-k assignments to e, over layers and tokens) / R      (no gradient; sums to k)
    P_e = (sum of p[:, e] over layers and tokens) / R               R = layers x tokens (no attention mask)
    aux = E x sum_e f_e P_e,       loss = cross-entropy + coef x aux

megatrain runs one block at a time and recomputes each layer in backward, so the sum is built the same way:
in the forward, each layer's routers add their top-k assignments and probability sums to small device
accumulators (no host sync); after the forward, f is known, and so is aux's gradient w.r.t. each p[t, e]:
w_e = coef x E x f_e / R, a constant over tokens and layers. In the backward, each layer's recomputed router
passes its logits through ``_BalanceGradient``, which adds softmax's backward of w to their gradient: that
layer's share of d(coef x aux)/dz, computed as transformers' autograd does (w cast to z's dtype, softmax's
backward). Nothing is kept per token between forward and backward. (A forward run with autograd on, whose
graph is kept for the backward, gets the same wrapping in the forward; ``weights`` is read when the backward
runs.) The first layer's forward begins a pass's statistics and the last layer's finishes them: training,
evaluation (whose loss includes coef x aux, as transformers' eval loss does) and logits alike.

What one step equals: the statistics cover the whole batch (every micro-batch, every position, padding
included, as transformers without an attention mask), so a step equals transformers' forward over the whole
batch in one call, whatever micro-batches the plan runs it in (the plan's choice changes no number). A
Trainer with gradient accumulation over micro-batches instead adds coef x aux of each micro-batch (its aux
term grows with their count); a one-micro-batch step is that. Data parallel: the counts and sums are
all-reduced after the forward, so the step equals one process on the global batch.

The counts of the experts actually routed to (the router's own top-k, used for the metrics) are kept per layer:
[layers, E] int64 on the device, read by the caller once per step with the loss. They count the tokens of the
step's rows and leave out its padding (``Batch.padding``): a router sees a micro-batch's rows [b, S] flattened,
whole or in sequence tiles taken in order, so each call's tokens are the next columns of that micro-batch's
mask. The load-balancing loss's statistics above keep every position, as transformers' without a mask.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from megatrain.models.layers import routing_observer

from megatrain.runtime.config import ModelConfig
from megatrain.runtime.distributed.collectives import Collectives
from megatrain.runtime.pipeline.experts.expert_parts import Part

__all__ = ["RouterBalance", "StepRouting"]


class StepRouting:
    """One step's (or one evaluation's) routing statistics on the device, and its load-balancing loss.

    ``tokens``: [layers, E] int64, the tokens each layer routed to each expert (top-k assignments, so a layer's
    row sums to k x positions). ``aux_loss``: [] fp32, transformers' ``aux_loss`` (unweighted) once the forward
    is done; None without the loss. Memory: a few [E] vectors and the [layers, E] counts.
    """

    def __init__(self, layers: int, experts: int, top_k: int, coef: float | None, device: torch.device,
                 collectives: Collectives | None, counted: list[torch.Tensor] | None = None) -> None:
        self.experts, self.top_k, self.coef = experts, top_k, coef
        self.dist = collectives
        # Per micro-batch, [b, S] bool on the device: the positions the token counts count (not padding); None: all.
        self.counted = counted
        self.tokens = torch.zeros(layers, experts, dtype=torch.int64, device=device)
        self.aux_loss: torch.Tensor | None = None
        # The loss's statistics (transformers' own top-k of softmax in the logits' dtype) and, after the
        # forward, the gradient of coef x aux w.r.t. each router probability: [E] fp32 each.
        self.assigned = torch.zeros(experts, dtype=torch.int64, device=device) if coef is not None else None
        self.prob_sum = torch.zeros(experts, dtype=torch.float32, device=device) if coef is not None else None
        self.weights: torch.Tensor | None = None

    def finish_forward(self) -> None:
        """Every layer has run forward: the global counts, aux and its gradient weights (device ops only)."""
        if self.dist is not None:
            self.tokens = self.dist.all_reduce_sum(self.tokens)
        if self.assigned is None or self.prob_sum is None:
            return
        if self.dist is not None:
            self.assigned = self.dist.all_reduce_sum(self.assigned)
            self.prob_sum = self.dist.all_reduce_sum(self.prob_sum)
        rows = (self.assigned.sum() // self.top_k).to(torch.float32)  # R: layers x positions
        fraction = self.assigned.to(torch.float32) / rows  # f_e
        self.aux_loss = torch.sum(fraction * (self.prob_sum / rows)) * self.experts
        # d(coef x aux)/dp[t, e], in the order transformers' autograd forms it.
        coef = torch.tensor(self.coef, dtype=torch.float32, device=rows.device)
        self.weights = (coef * self.experts) * fraction / rows

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The reported loss: ``loss`` (the cross-entropy) + coef x aux, as transformers' ``outputs.loss``."""
        if self.aux_loss is None:
            return loss
        return loss + self.coef * self.aux_loss


class _Recorder:
    """The forward's observer of one layer: counts the routed experts, adds the loss's statistics."""

    def __init__(self, step: StepRouting, layer: int) -> None:
        self.step, self.layer = step, layer
        self.micro, self.column = 0, 0  # where the next router call's tokens start in the counted masks

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        s = self.step
        if s.assigned is None or s.prob_sum is None:
            return logits
        with torch.no_grad():
            probs = torch.softmax(logits, dim=-1)  # in the logits' dtype, as transformers' loss takes them
            chosen = torch.topk(probs, s.top_k, dim=-1).indices.reshape(-1)
            s.assigned.scatter_add_(0, chosen, torch.ones_like(chosen))
            s.prob_sum += probs.float().reshape(-1, s.experts).sum(dim=0)
        return _with_gradient(logits, s)

    def routed(self, experts: torch.Tensor) -> None:
        flat = experts.reshape(-1)
        self.step.tokens[self.layer].scatter_add_(0, flat, self._counted(experts) if self.step.counted is not None
                                                  else torch.ones_like(flat))

    def _counted(self, experts: torch.Tensor) -> torch.Tensor:
        """1 for each (token, choice) of experts [T, k] that is no padding, else 0: [T x k] int64."""
        assert self.step.counted is not None
        mask = self.step.counted[self.micro]  # [b, S]: this micro-batch's rows
        width = experts.shape[0] // mask.shape[0]  # the router's tokens are [b, width] of them, flattened
        tokens = mask[:, self.column:self.column + width].reshape(-1, 1)
        self.column += width
        if self.column >= mask.shape[1]:
            self.micro, self.column = self.micro + 1, 0
        return tokens.expand(-1, experts.shape[1]).reshape(-1).to(torch.int64)


class _Gradient:
    """The backward's observer: the recomputed routers' logits carry the load-balancing loss's gradient."""

    def __init__(self, step: StepRouting) -> None:
        self.step = step

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        return _with_gradient(logits, self.step)

    def routed(self, experts: torch.Tensor) -> None:
        pass


def _with_gradient(logits: torch.Tensor, step: StepRouting) -> torch.Tensor:
    if step.coef is None or not (torch.is_grad_enabled() and logits.requires_grad):
        return logits
    return _BalanceGradient.apply(logits, step)


class _BalanceGradient(torch.autograd.Function):
    """Identity on the logits z [T, E]; backward adds softmax's backward of w (``StepRouting.weights``, read
    when the backward runs, so after the forward): the layer's share of d(coef x aux)/dz."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, step: StepRouting) -> torch.Tensor:
        ctx.step = step
        ctx.save_for_backward(logits)
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (logits,) = ctx.saved_tensors
        weights = ctx.step.weights
        assert weights is not None, "the load-balancing gradient is taken before the forward finished"
        probs = torch.softmax(logits, dim=-1)
        extra = torch.ops.aten._softmax_backward_data(weights.to(logits.dtype).expand_as(probs).contiguous(), probs,
                                                      -1, logits.dtype)
        return grad + extra, None


class RouterBalance:
    """The executor's routing bookkeeping (nothing for a dense model): a ``StepRouting`` per forward pass, begun by
    the first layer's forward and finished by the last one's; the backward's observer; the loss with aux added."""

    def __init__(self, config: ModelConfig, device: torch.device, collectives: Collectives | None) -> None:
        self.config, self.device, self.dist = config, device, collectives
        self.current: StepRouting | None = None  # the forward pass running or last run
        self.last: StepRouting | None = None  # the last training step's, for the metrics
        self.counted: list[torch.Tensor] | None = None  # the next training pass's masks (``count``)
        # The last pass's language-model loss (the cross-entropy, no load-balancing term): [] fp32 on the device.
        self.lm_loss: torch.Tensor | None = None

    def count(self, counted: list[torch.Tensor] | None) -> None:
        """The next training forward counts, per micro-batch, the positions where ``counted`` [b, S] is True
        (None: every position)."""
        self.counted = counted

    @contextlib.contextmanager
    def forward(self, layer: int, training: bool, part: Part | None = None) -> Iterator[None]:
        """Layer ``layer``'s forward reports its routing (a layer streamed in parts: its dense part, where it
        routes; [Note: expert groups]): layer 0 begins fresh statistics (``training``: over the
        ranks' global batch, kept as ``last``; else evaluation or logits, where each rank runs the whole batch it
        is given, nothing all-reduced), the last layer finishes them."""
        c = self.config
        if not c.num_experts or (part is not None and part.number > 0):
            yield
            return
        if layer == 0:
            self.current = StepRouting(c.num_hidden_layers, c.num_experts, c.num_experts_per_tok,
                                       c.router_aux_loss_coef, self.device, self.dist if training else None,
                                       self.counted if training else None)
            if training:
                self.last = self.current
        assert self.current is not None
        with routing_observer.observing(_Recorder(self.current, layer)):
            yield
        if layer == c.num_hidden_layers - 1:
            self.current.finish_forward()

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """The recomputed routers inside add the load-balancing loss's gradient (when the loss is on)."""
        if self.current is None or self.current.coef is None:
            yield
            return
        with routing_observer.observing(_Gradient(self.current)):
            yield

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The pass's reported loss: ``loss`` (the cross-entropy, kept as ``lm_loss``) + coef x aux when the loss
        is on."""
        self.lm_loss = loss
        return loss if self.current is None else self.current.loss(loss)
