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

Per-parameter gradient norms go into one device vector as each block finishes
(no host sync); clipping uses them as ``clip_grad_norm_`` does. The host waits
only where a CPU thread must: the AdamW worker for a drain, and a block's next
load for its update.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch.profiler import record_function

from megatrain.planner.plan import Plan

from megatrain.runtime.pipeline.activation_checkpoints import DeviceCheckpoints, HostCheckpoints
from megatrain.models.layers.attention import Documents
from megatrain.runtime.distributed.collectives import Collectives
from megatrain.runtime.pipeline.cpu_adamw import AdamHyper, AdamJob, AdamWorker
from megatrain.runtime.device.event_log import EventLog
from megatrain.runtime.pipeline.grad_buffers import GradBuffers
from megatrain.runtime.pipeline.head_loss import chunked_logits, head_forward_backward, head_loss
from megatrain.runtime.state.host_store import HostStore
from megatrain.models.layers.rope import attention_scaling, inverse_frequencies, rotary_tables
from megatrain.runtime.pipeline.sequence_tiles import tiled_layer_backward
from megatrain.runtime.pipeline.step_schedule import evaluation_schedule, training_schedule
from megatrain.runtime.pipeline.step_timer import StepTimer
from megatrain.runtime.device.streams import Event, Streams
from megatrain.runtime.model.templates import Block, BlockKind, Templates
from megatrain.runtime.pipeline.weight_slots import WeightLoader, WeightSlots


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


# What a layer takes besides its input, per micro-batch: cos, sin and the documents (None: the whole row).
Positions = tuple[torch.Tensor, torch.Tensor, "Documents | None"]


class PendingUpdate(NamedTuple):
    """A deferred-mode block update: submitted after backward, in forward order, with the clip coefficient."""
    block: Block
    grads: torch.Tensor | None  # fp32 host [numel] the drain writes; None: AdamW reads them from the grads file
    grads_ready: Event  # the drain's completion
    release: Callable[[], None] | None  # gives the grads' host slab back once AdamW has read it (eager / spilled)


class Executor:
    def __init__(
        self,
        templates: Templates,
        store: HostStore,
        plan: Plan,
        compute_dtype: torch.dtype,
        device: torch.device,
        max_grad_norm: float | None,
        log: EventLog,
        collectives: Collectives | None = None,
    ) -> None:
        self.templates, self.store, self.plan = templates, store, plan
        # Data parallel ([Note: collectives]): the store holds this rank's shards, a slot a whole padded block.
        self.dist = collectives
        slot_numel = store.max_block_numel if collectives is None else collectives.shards.slot_numel
        self.config = templates.config
        self.compute_dtype, self.device = compute_dtype, device
        self.max_grad_norm = max_grad_norm
        self.eager = plan.optimizer_mode == "eager"
        self.log = log
        self.streams = Streams(device) if collectives is None else collectives.streams
        self.timer = StepTimer(self.streams.cuda)
        pin = device.type == "cuda"
        blocks = templates.blocks
        self.slots = WeightSlots(plan.num_slots, slot_numel, compute_dtype, device, self.streams)
        self.grad_buffers = GradBuffers(plan.device_grad_buffers, slot_numel, device, self.streams, self.timer)
        self.schedule = training_schedule(templates)  # the step's loads: [Note: load sequence]
        self.evaluation = evaluation_schedule(templates)
        # Tied embeddings: the head's lm_head gradient lands here in forward and the embedding's
        # own in backward; one extra fp32 buffer of the embedding's size, resident for the whole step.
        self.tied_grad = (torch.zeros(self._grad_numel(templates.embed), dtype=torch.float32, device=device)
                          if self.schedule.tied else None)
        self.tied_drained: Event = self.streams.event()
        self.checkpoints: DeviceCheckpoints | HostCheckpoints = (
            HostCheckpoints(plan.checkpoint_piece_tokens, compute_dtype, device, self.streams, pin, self.timer, log)
            if plan.checkpoints == "host" else DeviceCheckpoints()
        )
        self.adam = AdamWorker(store, self.schedule.update_order(self.eager), log)  # its jobs come in this order
        # What AdamW updates of each block: the whole layout, or this rank's shard of it.
        self.adam_layouts = [b.layout for b in (blocks if collectives is None else collectives.shards.blocks)]
        if store.spill_files is not None:
            files, adam = store.spill_files, self.adam
            self.timer.counters = lambda: {  # noqa: E731  [Note: roofline]: the disk's busy and wait seconds
                "disk_read_busy_s": files.read_clock.seconds, "disk_write_busy_s": files.write_clock.seconds,
                "disk_busy_s": files.io_clock.seconds, "adam_disk_wait_s": adam.disk_wait_seconds}
        self.step_no = 0  # optimizer steps completed or in flight
        self.loader = WeightLoader(self.slots, store, self.streams, plan.prefetch_depth, self._wait_updated,
                                   log, self.timer,
                                   fill=None if collectives is None else collectives.fill_slot)
        order = {name: i for i, name in enumerate(templates.hf_parameter_order())}
        self.norm_index = [torch.tensor([order[e.hf_name] for e in b.layout.entries], device=device) for b in blocks]
        # Per-parameter gradient norms in model.parameters() order, filled as blocks finish.
        self.norms = torch.zeros(len(order), dtype=torch.float32, device=device)
        # The clip coefficient: a device scalar of its own (a temporary could be reused by the allocator
        # before its D2H ran), copied to (pinned) host memory for the AdamW worker; rewritten only after
        # the compute stream waited for the previous copy.
        self.clip_dev = torch.zeros((), dtype=torch.float32, device=device)
        self.clip_host = torch.zeros((), dtype=torch.float32, pin_memory=pin)
        self.clip_copied: Event = self.streams.event()
        self.grad_norm: torch.Tensor | None = None
        # Predicted tokens of the last step's (or evaluation's) rows whose argmax is their label: [] int64.
        self.correct = torch.zeros((), dtype=torch.int64, device=self.device)
        self.mlp_tile = plan.mlp_tile_tokens or 0  # [Note: sequence tiles]
        self.attention_tile = plan.attention_tile_tokens or 0
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per length: fp32 cos, sin (rope.py)

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
        positions = self._positions(batch.input_ids.shape[1], batch.micro, batch.position_ids, batch.documents)
        self.checkpoints.begin(len(s.layers), *batch.input_ids.shape, self.config.hidden_size, batch.micro)
        self.loader.start(step, s.loads)
        pending: list[PendingUpdate] = []  # deferred mode: submitted once the global norm is known

        # ---- forward: embedding, then each layer (saving its inputs)
        with torch.no_grad():
            with self.loader.resident(s.embed) as params, record_function(f"fwd[{s.embed.block.index}]"):
                x = [self.templates.run(BlockKind.EMBED, params, batch.input_ids[rows]) for rows in batch.micro]
            for load in s.layers:
                with self.loader.resident(load) as params, record_function(f"fwd[{load.block.index}]"):
                    for m, rows in enumerate(batch.micro):
                        self.checkpoints.save(load.layer, m, rows, x[m])
                        x[m] = self._layer_forward(params, x[m], positions[m])
        self.checkpoints.flush()

        # ---- head: loss and its gradient at once, chunk by chunk (with a tied lm_head, the embedding's table)
        head = s.head.block
        with self.loader.resident_together(s.head_loads) as held:
            head_params = held[0]
            g_index, g_buf = self.grad_buffers.acquire(self._grad_numel(head))
            g_views = head.layout.views(g_buf)
            lm_weight, lm_grad = s.lm_weight(held), self._lm_grad(g_views)
            norm_params = {k: v for k, v in head_params.items() if k.startswith("norm.")}
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
            dy: list[torch.Tensor] = []
            with record_function(f"head[{head.index}]"):
                for m, rows in enumerate(batch.micro):
                    out = head_forward_backward(
                        lambda p, h: self.templates.run(BlockKind.HEAD, {**head_params, **p}, h), norm_params,
                        lm_weight, x[m], batch.labels[rows], batch.n_tokens, self.plan.loss_chunk_tokens, lm_grad,
                        self.correct)
                    loss = loss + out.loss
                    dy.append(out.dx)
                    for name, g in out.norm.items():
                        g_views[name].add_(g)
            del x
        pending += self._finish_block(step, head, g_index, g_buf, hyper)

        # ---- backward: recompute each layer from its checkpoint, backprop dy
        for load in s.backward:
            layer = load.block
            with self.loader.resident(load) as params:
                g_index, g_buf = self.grad_buffers.acquire(self._grad_numel(layer))
                g_list = layer.layout.view_list(g_buf)
                with record_function(f"bwd[{layer.index}]"):
                    for m, rows in enumerate(batch.micro):
                        x_in = self.checkpoints.get(load.layer, m, rows)
                        dy[m] = self._layer_backward(layer, params, x_in, dy[m], positions[m], g_list)
            pending += self._finish_block(step, layer, g_index, g_buf, hyper)

        # ---- embedding backward: a scatter-add of dy into the rows used; no weights needed
        embed = s.embed.block
        e_index: int | None = None  # tied: the embedding's own buffer, which holds lm_head's gradient already
        if self.tied_grad is not None:
            e_buf = self.tied_grad
        else:
            e_index, e_buf = self.grad_buffers.acquire(self._grad_numel(embed))
        table = embed.layout.views(e_buf)["embed_tokens.weight"]
        pad = -1 if self.config.pad_token_id is None else self.config.pad_token_id
        with record_function(f"bwd[{embed.index}]"):
            for m, rows in enumerate(batch.micro):
                table.add_(torch.ops.aten.embedding_dense_backward(
                    dy[m], batch.input_ids[rows], self.config.vocab_size, pad, False))
        del dy
        pending += self._finish_block(step, embed, e_index, e_buf, hyper)

        # ---- global norm, clip coefficient, and the deferred updates in forward order
        clip = self._clip_coefficient()
        for update in sorted(pending, key=lambda u: u.block.index):
            self._submit(step, update.block, update.grads, update.grads_ready, clip, hyper, update.release)
        self.timer.end(self.streams.compute)
        return loss if self.dist is None else self.dist.all_reduce_sum(loss)

    def _layer_forward(self, params: dict[str, torch.Tensor], x: torch.Tensor, positions: Positions) -> torch.Tensor:
        """A decoder layer's forward ([b, S, hidden] -> same) with the plan's sequence tiles."""
        return self.templates.run(BlockKind.LAYER, params, x, *positions, self.mlp_tile, "layer", self.attention_tile)

    def _layer_backward(self, layer: Block, params: dict[str, torch.Tensor], x_in: torch.Tensor, dy: torch.Tensor,
                        positions: Positions, g_list: list[torch.Tensor]) -> torch.Tensor:
        """One micro-batch through ``layer`` again from its checkpoint x_in ([b, S, hidden]), autograd on: the
        parameter gradients add into ``g_list`` (fp32, layout order); returns the gradient w.r.t. x_in."""
        x_in = x_in.detach().requires_grad_()
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        index = {e.local_name: i for i, e in enumerate(layer.layout.entries)}

        def add_grads(by_name: dict[str, torch.Tensor]) -> None:
            names = list(by_name)
            torch._foreach_add_([g_list[index[n]] for n in names], [by_name[n] for n in names])

        seq = x_in.shape[1]
        if 0 < self.mlp_tile < seq or 0 < self.attention_tile < seq:  # [Note: sequence tiles]
            run = functools.partial(self.templates.run, BlockKind.LAYER)
            return tiled_layer_backward(run, leaves, x_in, dy, positions, self.mlp_tile if 0 < self.mlp_tile < seq
                                        else seq, add_grads, self.attention_tile)
        with torch.enable_grad():
            out = self.templates.run(BlockKind.LAYER, leaves, x_in, *positions)
        grads = torch.autograd.grad(out, (x_in, *leaves.values()), dy)
        by_name = dict(zip(leaves.keys(), grads[1:]))
        torch._foreach_add_(g_list, [by_name[e.local_name] for e in layer.layout.entries])
        return grads[0]

    def _grad_numel(self, block: Block) -> int:
        """Elements of block's device gradient buffer: its layout, padded to whole shards in data parallel."""
        return block.layout.numel if self.dist is None else self.dist.shards.padded(block.index)

    def _lm_grad(self, head_grads: dict[str, torch.Tensor]) -> torch.Tensor:
        """Where lm_head's gradient ([vocab, hidden] fp32) adds up: the head's own buffer, or with tied
        embeddings the embedding's (zeroed once its previous step's drain is done)."""
        if self.tied_grad is None:
            return head_grads["lm_head.weight"]
        with self.timer.stall("d2h", self.streams.compute):
            self.streams.compute.wait_event(self.tied_drained)
        self.tied_grad.zero_()
        return self.schedule.embed.block.layout.views(self.tied_grad)["embed_tokens.weight"]

    def _clip_coefficient(self) -> tuple[torch.Tensor, Event] | None:
        """The global norm (``grad_norm``) and, with clipping, the coefficient on its way to the host."""
        self.grad_norm = torch.linalg.vector_norm(self.norms, 2.0) if self.dist is None else self.dist.global_norm()
        if self.max_grad_norm is None:
            return None
        with self.timer.stall("d2h", self.streams.compute):
            self.streams.compute.wait_event(self.clip_copied)
        self.clip_dev.copy_(torch.clamp(self.max_grad_norm / (self.grad_norm + 1e-6), max=1.0))
        self.clip_copied = self._drain_scalar(self.clip_dev, self.clip_host)
        return self.clip_host, self.clip_copied

    def _finish_block(
        self, step: int, block: Block, g_index: int | None, g_buf: torch.Tensor, hyper: AdamHyper
    ) -> list[PendingUpdate]:
        """Record the block's gradient norms, drain its grads to the host, queue (eager) its update.
        Data parallel: the drain is of this rank's shard of the gradient summed over ranks."""
        reduced: Event | None = None
        if self.dist is None:
            norms = torch._foreach_norm(block.layout.view_list(g_buf), 2.0)
            self.norms.index_copy_(0, self.norm_index[block.index], torch.stack(norms))
        else:
            g_buf, reduced = self.dist.reduce_scatter(block.index, g_index, g_buf)
        # One sink per piece: the whole block in RAM; a chunk at a time when the gradients spill.
        sinks = iter(self.store.grad_sinks(block.index, check=self.adam.raise_if_failed))
        while True:
            with self.timer.adam_wait(self.streams.compute):  # waits only while every slab awaits its update
                piece = next(sinks, None)
            if piece is None:
                break
            sink = piece
            with record_function(f"d2h[{block.index}]"):
                done = self.grad_buffers.drain(g_index, g_buf[sink.lo:sink.lo + sink.host.numel()], sink.host,
                                               after=reduced)
            sink.on_drained(done)
        if g_index is None:
            self.tied_drained = done
        self.log.record("d2h", step, block.index)
        if sink.for_adam is None:  # spilled grads: AdamW reads the block back from the grads file
            return [PendingUpdate(block, None, self.streams.event(), None)]
        if self.eager:
            self._submit(step, block, sink.for_adam, done, None, hyper, sink.release)
            return []
        return [PendingUpdate(block, sink.for_adam, done, sink.release)]

    def _submit(self, step: int, block: Block, host: torch.Tensor | None, done: Event,
                clip: tuple[torch.Tensor, Event] | None, hyper: AdamHyper, release: Callable[[], None] | None) -> None:
        self.log.record("adam_submit", step, block.index)
        self.adam.submit(AdamJob(step, block.index, host, done, clip, hyper, self.adam_layouts[block.index], release))

    def _drain_scalar(self, value: torch.Tensor, host: torch.Tensor) -> Event:
        ready = self.streams.recorded(self.streams.compute)
        with self.streams.d2h.use():
            self.streams.d2h.wait_event(ready)
            host.copy_(value, non_blocking=True)
            return self.streams.recorded(self.streams.d2h)

    def _wait_updated(self, block: int, step: int) -> None:
        """The loader's wait for AdamW's update of ``block`` for ``step``: exposed optimizer time, if any."""
        with self.timer.adam_wait(self.streams.compute):
            self.adam.wait_updated(block, step)

    def _rotary(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin for ``seq`` positions, one pair per length (the latest few kept)."""
        if seq not in self._rope:
            if len(self._rope) >= 4:
                self._rope.pop(next(iter(self._rope)))
            inv_freq = inverse_frequencies(self.config, seq)
            self._rope[seq] = rotary_tables(inv_freq, seq, self.device, attention_scaling(self.config))
        return self._rope[seq]

    def _positions(self, seq: int, micro: list[slice], position_ids: torch.Tensor | None,
                   documents: list[Documents | None] | None) -> list[Positions]:
        """Each micro-batch's cos, sin and documents. Packed rows: the table's rows gathered by position id on
        the device ([b, S, head_dim / 2], the values transformers computes for those positions), no host sync."""
        cos, sin = self._rotary(seq)
        if position_ids is None or documents is None:
            return [(cos, sin, None)] * len(micro)
        return [(cos[0][position_ids[rows]], sin[0][position_ids[rows]], docs) for rows, docs in zip(micro, documents)]

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
        positions = self._positions(batch.input_ids.shape[1], batch.micro, batch.position_ids, batch.documents)
        # Each load waits for its block's latest update (step_no), as the next step's would: no global wait.
        self.loader.start(self.step_no + 1, s.loads)
        with self.loader.resident(s.embed) as params:
            x = [self.templates.run(BlockKind.EMBED, params, batch.input_ids[rows]) for rows in batch.micro]
        for load in s.layers:
            with self.loader.resident(load) as params:
                for m in range(len(batch.micro)):
                    x[m] = self._layer_forward(params, x[m], positions[m])
        with self.loader.resident_together(s.head_loads) as held:
            head_params = held[0]
            lm_weight = s.lm_weight(held)
            norm_params = {k: v for k, v in head_params.items() if k.startswith("norm.")}
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
            for m, rows in enumerate(batch.micro):
                loss = loss + head_loss(lambda p, h: self.templates.run(BlockKind.HEAD, {**head_params, **p}, h),
                                        norm_params, lm_weight, x[m], batch.labels[rows], batch.n_tokens,
                                        self.plan.loss_chunk_tokens, self.correct)
        return loss

    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                       documents: Documents | None = None) -> torch.Tensor:
        """input_ids: [B, S] on the device -> logits [B, S, vocab] fp32 (materialised: for evaluation).
        ``position_ids`` and ``documents``: packed rows, as in ``Batch``."""
        self.adam.wait_all(self.step_no)
        s = self.evaluation
        (positions,) = self._positions(input_ids.shape[1], [slice(None)], position_ids,
                                       None if documents is None else [documents])
        self.loader.start(self.step_no, s.loads)
        with self.loader.resident(s.embed) as params:
            x = self.templates.run(BlockKind.EMBED, params, input_ids)
        for load in s.layers:
            with self.loader.resident(load) as params:
                x = self._layer_forward(params, x, positions)
        with self.loader.resident_together(s.head_loads) as held:
            normed = self.templates.run(BlockKind.HEAD, held[0], x)
            flat = normed.reshape(-1, normed.shape[-1])
            logits = chunked_logits(flat, s.lm_weight(held), self.plan.loss_chunk_tokens).float()
        return logits.view(*input_ids.shape, -1)

    def close(self) -> None:
        self.adam.close()
        if isinstance(self.checkpoints, HostCheckpoints):
            self.checkpoints.close()
