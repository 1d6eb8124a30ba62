"""One training step, block-major: the whole batch passes through each block while it is resident.

[Note: block-major step]
Forward: for each block, every micro-batch runs while the block's weights are
in a slot (layer inputs saved as activation checkpoints); the head computes the
loss and its own gradient at once (chunked cross-entropy), so backward starts
from dy. Backward: for each layer in reverse, every micro-batch is recomputed
from its checkpoint with autograd on and backpropagated, the parameter
gradients accumulating in one fp32 device buffer, which then drains to the host
while the next layer computes. The embedding's backward needs no weights.
Weight traffic per step is fixed; compute grows with the number of micro-batches.
The loads, in order, are step_schedule.py's ([Note: load sequence]); each block
computes inside ``with loader.resident(load)``.

Training, evaluation and logits share one forward loop (``_forward``), so an
evaluation's loss is the same bits as the loss a step on that batch reports.
What happens to a block's gradient once computed (norms, drain, AdamW update,
clipping) is block_updates.py's. The host waits only where a CPU thread must:
the AdamW worker for a drain, and a block's next load for its update.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
from torch.profiler import record_function

from megatrain.plan.plan import Plan

from megatrain.models.layers.attention import Documents

from megatrain.runtime.device import host_threads
from megatrain.runtime.device.event_log import EventLog
from megatrain.runtime.device.streams import Streams
from megatrain.runtime.distributed.collectives import Collectives
from megatrain.runtime.model.compiled_layers import LayerRunner
from megatrain.runtime.model.head_loss import chunked_logits, head_forward_backward, head_loss
from megatrain.runtime.model.layer_backward import recompute_backward
from megatrain.runtime.model.rotary_positions import LayerPositions, Positions, RotaryPositions
from megatrain.runtime.model.sequence_tiles import AddGrads
from megatrain.runtime.model.templates import Block, BlockKind, Templates
from megatrain.runtime.optim.adamw_kernel import AdamHyper
from megatrain.runtime.optim.block_optimizer import BlockOptimizer
from megatrain.runtime.pipeline.activation_checkpoints import DeviceCheckpoints, HostCheckpoints
from megatrain.runtime.pipeline.block_updates import BlockUpdates, PendingUpdate
from megatrain.runtime.pipeline.experts.expert_layers import ExpertLayers
from megatrain.runtime.pipeline.experts.expert_parts import streamed_parts
from megatrain.runtime.pipeline.experts.router_balance import RouterBalance
from megatrain.runtime.pipeline.grad_buffers import BlockGrads, GradBuffers, TiedGrad, grad_unit
from megatrain.runtime.pipeline.kept_layers import KeptGraphs
from megatrain.runtime.pipeline.step_schedule import StepSchedule, evaluation_schedule, training_schedule
from megatrain.runtime.pipeline.step_timer import StepTimer
from megatrain.runtime.pipeline.weight_slots import WeightLoader, WeightSlots
from megatrain.runtime.state.host_store import HostStore

__all__ = ["Batch", "Executor", "Positions"]

HeadNorm = Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor]  # the head's final norm(params, x)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] int64 on the device
    labels: torch.Tensor  # [B, S] int64 on the device, already shifted (position t predicts t + 1)
    n_tokens: torch.Tensor  # [] int64 on the device: tokens predicted in the whole batch
    micro: list[slice]  # rows of each micro-batch, in order
    # Packed documents ([Note: document attention]): per-token RoPE positions [B, S] int64 on the device and
    # each micro-batch's documents (host data); None: one sequence per row, positions 0..S-1.
    position_ids: torch.Tensor | None = None
    documents: list[Documents | None] | None = None
    # Decoder layers whose forward graph is kept for backward, not recomputed ([Note: kept layers]).
    kept: frozenset[int] = frozenset()
    # [B, S] bool on the device, True at padding: left out of the experts' token counts; None: no padding given.
    padding: torch.Tensor | None = None


class Executor:
    def __init__(self, templates: Templates, store: HostStore, plan: Plan, compute_dtype: torch.dtype,
                 device: torch.device, max_grad_norm: float | None, log: EventLog,
                 collectives: Collectives | None = None) -> None:
        self.templates, self.store, self.plan = templates, store, plan
        # Data parallel ([Note: collectives]): the store holds this rank's shards, a slot a whole padded block.
        self.dist = collectives
        slot_numel = store.max_block_numel if collectives is None else collectives.shards.slot_numel
        self.parts, slot_numel = streamed_parts(templates, plan, store, collectives is not None, slot_numel)
        self.config = templates.config
        self.compute_dtype, self.device = compute_dtype, device
        self.log = log
        self.streams = Streams(device) if collectives is None else collectives.streams
        self.timer = StepTimer(self.streams.cuda, adam_inline=plan.adam_thread == "compute")
        in_place = plan.compute_in_place  # [Note: compute in place]: slots and gradient buffers hold nothing
        host_grads = (lambda b: store.grad_sink(b).host) if in_place else None  # noqa: E731
        self.schedule = training_schedule(templates, self.parts)  # the step's loads: [Note: load sequence]
        self.evaluation = evaluation_schedule(templates, self.parts)
        self.slots = WeightSlots(plan.num_slots, 0 if in_place else slot_numel, compute_dtype, device, self.streams)
        # [Note: resident blocks]: gradients add up in their own buffers (data parallel: the reduce-scatter's copied in)
        resident = frozenset(plan.resident_blocks) if collectives is None else frozenset()
        self.grad_buffers = GradBuffers(plan.device_grad_buffers, 0 if in_place else grad_unit(  # (tied: tied_grad's)
            templates, self.parts, self._grad_numel, self.schedule.tied, resident), device, self.streams, self.timer,
            host_grads, store.resident_grads if collectives is None else lambda b: None)
        e = templates.embed  # tied: lm_head's gradient and the embedding's in one buffer for the step
        own = host_grads(e.index) if host_grads else store.resident_grads(e.index) if e.index in resident else None
        tied = self.schedule.tied
        self.tied = TiedGrad(e, self._grad_numel(e), device, own, self.streams, self.timer) if tied else None
        self.tied_grad = None if self.tied is None else self.tied.buffer
        self.checkpoints: DeviceCheckpoints | HostCheckpoints = (
            HostCheckpoints(plan.checkpoint_piece_tokens, compute_dtype, device, self.streams, device.type == "cuda",
                            self.timer, log)
            if plan.checkpoints == "host" else DeviceCheckpoints()
        )
        eager = plan.optimizer_mode == "eager"
        # Its jobs come in this order; on a CPU device the compute thread owns the cores, on a GPU a rank takes its
        # node's share: [Note: helper threads]. What AdamW updates of each block: the whole layout, or this rank's
        # shard of it.
        layouts = [b.layout for b in (templates.blocks if collectives is None else collectives.shards.blocks)]
        local_ranks = 1 if collectives is None else collectives.topology.local_world_size
        self.optim = BlockOptimizer(store, self.schedule.update_order(eager), layouts, log, self.streams,
                                    threads=host_threads.helper_threads(device.type == "cuda", local_ranks),
                                    inline=plan.adam_thread == "compute",
                                    device_busy=self.timer.device_adam)
        self.updates = BlockUpdates(templates, store, self.optim, self.grad_buffers, self.streams, self.timer, log,
                                    eager, max_grad_norm, device, collectives)
        self.timer.counters = self.optim.counters if store.spilled else None  # [Note: roofline]: the disk's seconds
        self.step_no = 0  # optimizer steps completed or in flight
        self.loader = WeightLoader(self.slots, store, self.streams, plan.prefetch_depth, self.optim,
                                   log, self.timer, fill=None if collectives is None else collectives.fill_slot,
                                   in_place=in_place)
        self.rotary, self.routing = RotaryPositions(self.config, device), RouterBalance(self.config, device, self.dist)
        # Predicted tokens of the last step's (or evaluation's) rows whose argmax is their label: [] int64.
        self.correct = torch.zeros((), dtype=torch.int64, device=self.device)
        self.kept = KeptGraphs(log)  # [Note: kept layers]
        self.run_layer = LayerRunner(templates, plan.compiled_layers)  # eager, or [Note: compiled layers]
        self.mlp_tile = plan.mlp_tile_tokens or 0  # [Note: sequence tiles]
        self.attention_tile = plan.attention_tile_tokens or 0
        self.cap = self.config.family_field("final_logit_softcapping")  # the head's logit soft-cap (model/head_loss.py)
        self.expert_layers = ExpertLayers(templates, self.routing, self.checkpoints, self.grad_buffers, self.updates,
                                          self.attention_tile)  # layers streamed in parts: [Note: expert groups]

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The last step's global gradient norm (before clipping), a device scalar."""
        return self.updates.grad_norm

    def restore(self, step: int) -> None:
        """Continue from optimizer step ``step`` of a checkpoint, every update up to it applied."""
        self.step_no = step
        self.optim.restore(step)

    # ------------------------------------------------------------------ the step
    def train_step(self, batch: Batch, hyper: AdamHyper) -> torch.Tensor:
        """One optimizer step over ``batch``; returns the mean loss as a device scalar (no sync)."""
        self.step_no += 1
        step, s = self.step_no, self.schedule
        self.correct = torch.zeros((), dtype=torch.int64, device=self.device)
        self.timer.begin(self.streams.compute)
        if self.dist is not None:  # every rank divides its loss by the global count of predicted tokens
            self.dist.begin_step()
            batch.n_tokens = self.dist.all_reduce_sum(batch.n_tokens)
        positions = self._positions(batch)
        self.routing.count(None if batch.padding is None else [~batch.padding[rows] for rows in batch.micro])
        self.kept.begin(batch.kept)
        self.checkpoints.begin([b.layer for b in self.templates.layers if b.layer not in batch.kept],
                               *batch.input_ids.shape, self.config.hidden_size, batch.micro)
        self.loader.start(step, s.loads)
        pending: list[PendingUpdate] = []  # deferred mode: submitted once the global norm is known

        # ---- forward: embedding, then each layer (saving its inputs)
        x = self._forward(s, batch.input_ids, batch.micro, positions, training=True)
        self.checkpoints.flush()
        self.timer.forward_end()

        # ---- head: loss and its gradient at once, chunk by chunk (with a tied lm_head, the embedding's table)
        head = s.head.block
        with self.loader.resident_together(s.head_loads) as held:
            g_index, g_buf = self.grad_buffers.acquire(self._grad_numel(head), head.index)
            g_views = head.layout.views(g_buf)
            lm_weight, lm_grad = s.lm_weight(held), self._lm_grad(g_views)
            norm, norm_params = _head_norm(self.templates, held[0])
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
            dy: list[torch.Tensor] = []
            with record_function(f"head[{head.index}]"):
                for m, rows in enumerate(batch.micro):
                    out = head_forward_backward(norm, norm_params, lm_weight, x[m], batch.labels[rows], batch.n_tokens,
                                                self.plan.loss_chunk_tokens, lm_grad, self.correct, self.cap)
                    loss = loss + out.loss
                    dy.append(out.dx)
                    for name, g in out.norm.items():
                        g_views[name].add_(g)
            del x
        pending += self.updates.finish(step, head, g_index, g_buf, hyper)

        # ---- backward: recompute each layer from its checkpoint, backprop dy
        for load in s.backward:
            layer = load.block
            with self.loader.resident(load) as params:
                if load.part is not None:
                    pending += self.expert_layers.backward(step, load, params, batch.micro,
                                                           positions[layer.layer_type], dy, hyper)
                    continue
                g_index, g_buf = self.grad_buffers.acquire(self._grad_numel(layer), layer.index, zeroed=False)
                grads = BlockGrads(layer.layout, g_buf)  # each gradient copied in where first, then added
                with record_function(f"bwd[{layer.index}]"), self.routing.backward():
                    for m, rows in enumerate(batch.micro):
                        if self.kept.holds(load.layer):  # [Note: kept layers]: through its forward's graph
                            dy[m] = self.kept.backward(load.layer, m, params, dy[m], grads.add)
                            continue
                        x_in = self.checkpoints.get(load.layer, m, rows)
                        dy[m] = self._layer_backward(layer, params, x_in, dy[m], positions[layer.layer_type][m],
                                                     grads.add)
                    grads.close()
            pending += self.updates.finish(step, layer, g_index, g_buf, hyper)

        # ---- embedding backward: a scatter-add of dy into the rows used; no weights needed
        embed = s.embed.block
        e_index: int | None = None  # tied: the embedding's own buffer, which holds lm_head's gradient already
        if self.tied_grad is not None:
            e_buf = self.tied_grad
        else:
            e_index, e_buf = self.grad_buffers.acquire(self._grad_numel(embed), embed.index, zeroed=False)
        e_grads = BlockGrads(embed.layout, e_buf, holding=self.tied_grad is not None)
        with record_function(f"bwd[{embed.index}]"):
            for m, rows in enumerate(batch.micro):
                e_grads.add({"embed_tokens.weight": self.templates.embedding_backward(dy[m], batch.input_ids[rows])})
            e_grads.close()
        del dy
        pending += self.updates.finish(step, embed, e_index, e_buf, hyper)

        # ---- global norm, clip coefficient, and the deferred updates in forward order
        self.updates.submit_pending(step, pending, hyper)
        self.timer.end(self.streams.compute)
        return self.routing.loss(loss if self.dist is None else self.dist.all_reduce_sum(loss))  # + aux, if on

    def _forward(self, s: StepSchedule, input_ids: torch.Tensor, micro: list[slice], positions: LayerPositions,
                 training: bool = False) -> list[torch.Tensor]:
        """The forward training, evaluation and logits share: the embedding, then each layer, every micro-batch
        (rows of input_ids [B, S]) while the block is resident; returns each one's hidden states [b, S, hidden].
        ``training``: each layer's inputs are saved as activation checkpoints and each block's phase is labelled."""
        with torch.no_grad():
            with self.loader.resident(s.embed) as params, _label("fwd", s.embed.block, training):
                x = [self.templates.run(BlockKind.EMBED, params, input_ids[rows]) for rows in micro]
            for load in s.layers:
                with self.loader.resident(load) as params, _label("fwd", load.block, training), \
                        self.routing.forward(load.layer, training, load.part):
                    if load.part is not None:
                        self.expert_layers.forward(load, params, x, micro, positions[load.block.layer_type], training)
                        continue
                    own = positions[load.block.layer_type]  # this layer type's positions per micro-batch
                    for m, rows in enumerate(micro):
                        if training and self.kept.holds(load.layer):  # [Note: kept layers]
                            x[m] = self.kept.forward(load.layer, m, functools.partial(
                                self._layer_forward, load.block, positions=own[m]), params, x[m], own[m][:2])
                            continue
                        if training:
                            self.checkpoints.save(load.layer, m, rows, x[m])
                        x[m] = self._layer_forward(load.block, params, x[m], own[m])
        return x

    def _layer_forward(self, layer: Block, params: dict[str, torch.Tensor], x: torch.Tensor,
                       positions: Positions) -> torch.Tensor:
        """A decoder layer's forward ([b, S, hidden] -> same) with the plan's sequence tiles."""
        return self.run_layer(layer, params, x, *positions, self.mlp_tile, "layer", self.attention_tile)

    def _layer_backward(self, layer: Block, params: dict[str, torch.Tensor], x_in: torch.Tensor, dy: torch.Tensor,
                        positions: Positions, add_grads: AddGrads) -> torch.Tensor:
        """One micro-batch through ``layer`` again from its checkpoint x_in: model/layer_backward.py."""
        self.log.record("recompute", self.step_no, layer.index)
        return recompute_backward(self.run_layer, layer, params, x_in, dy, positions, add_grads, self.mlp_tile,
                                  self.attention_tile)

    def _grad_numel(self, block: Block) -> int:
        """Elements of block's device gradient buffer: its layout, padded to whole shards in data parallel."""
        return block.layout.numel if self.dist is None else self.dist.shards.padded(block.index)

    def _lm_grad(self, head_grads: dict[str, torch.Tensor]) -> torch.Tensor:
        """Where lm_head's gradient ([vocab, hidden] fp32) adds up: the head's own buffer, or with tied
        embeddings the embedding's (``TiedGrad.for_head``)."""
        return head_grads["lm_head.weight"] if self.tied is None else self.tied.for_head(self.updates.tied_drained)

    def _positions(self, batch: Batch) -> LayerPositions:
        return self.rotary.positions(batch.input_ids.shape[1], batch.micro, batch.position_ids, batch.documents)

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, batch: Batch) -> torch.Tensor:
        """The mean loss over ``batch`` with the current weights; returns a device scalar (no sync).

        The forward of ``train_step`` (the same micro-batches, blocks and loss chunks, so the same bits as the
        loss a step on this batch reports) on the evaluation load sequence; nothing of the training state
        changes: no gradient, no update, no step count, no activation checkpoint, no timing.
        """
        s = self.evaluation
        self.correct = torch.zeros((), dtype=torch.int64, device=self.device)
        positions = self._positions(batch)
        # Each load waits for its block's latest update (step_no), as the next step's would: no global wait.
        self.loader.start(self.step_no + 1, s.loads)
        x = self._forward(s, batch.input_ids, batch.micro, positions)
        with self.loader.resident_together(s.head_loads) as held:
            norm, norm_params = _head_norm(self.templates, held[0])
            lm_weight = s.lm_weight(held)
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
            for m, rows in enumerate(batch.micro):
                loss = loss + head_loss(norm, norm_params, lm_weight, x[m], batch.labels[rows], batch.n_tokens,
                                        self.plan.loss_chunk_tokens, self.correct, self.cap)
        return self.routing.loss(loss)

    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                       documents: Documents | None = None) -> torch.Tensor:
        """input_ids: [B, S] on the device -> logits [B, S, vocab] fp32 (materialised: for evaluation).
        ``position_ids`` and ``documents``: packed rows, as in ``Batch``."""
        self.optim.wait_all(self.step_no)
        s = self.evaluation
        whole = [slice(None)]  # one micro-batch: every row
        positions = self.rotary.positions(input_ids.shape[1], whole, position_ids,
                                          None if documents is None else [documents])
        self.loader.start(self.step_no, s.loads)
        (x,) = self._forward(s, input_ids, whole, positions)
        with self.loader.resident_together(s.head_loads) as held:
            normed = self.templates.run(BlockKind.HEAD, held[0], x)
            flat = normed.reshape(-1, normed.shape[-1])
            logits = chunked_logits(flat, s.lm_weight(held), self.plan.loss_chunk_tokens, self.cap).float()
        return logits.view(*input_ids.shape, -1)

    def close(self) -> None:
        self.loader.close()  # its jobs wait for AdamW's updates: stopped before the worker
        self.optim.close()
        if isinstance(self.checkpoints, HostCheckpoints):
            self.checkpoints.close()


def _label(phase: str, block: Block, labelled: bool) -> ContextManager[object]:
    """The profiler's label of a phase of the training step (``fwd[7]``); evaluation runs unlabelled."""
    return record_function(f"{phase}[{block.index}]") if labelled else contextlib.nullcontext()


def _head_norm(templates: Templates, head_params: dict[str, torch.Tensor]) -> tuple[HeadNorm, dict[str, torch.Tensor]]:
    """The head's final norm as ``model/head_loss.py`` takes it: norm(params, x), and its own parameters."""
    norm_params = {k: v for k, v in head_params.items() if k.startswith("norm.")}
    return (lambda p, h: templates.run(BlockKind.HEAD, {**head_params, **p}, h)), norm_params
