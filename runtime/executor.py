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

Per-parameter gradient norms go into one device vector as each block finishes
(no host sync); clipping uses them as ``clip_grad_norm_`` does. The host waits
only where a CPU thread must: the AdamW worker for a drain, and a block's next
load for its update.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.profiler import record_function

from megatrain.planner.plan import Plan

from .checkpoints import DeviceCheckpoints, HostCheckpoints
from .chunked_loss import chunked_logits, head_forward_backward
from .cpu_adamw import AdamHyper, AdamJob, AdamWorker
from .event_log import EventLog
from .grad_buffers import GradBuffers
from .host_store import HostStore
from .rope import inverse_frequencies, rotary_tables
from .step_timer import StepTimer
from .streams import Event, Streams
from .templates import Block, BlockKind, Templates
from .weight_slots import WeightLoader, WeightSlots


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] int64 on the device
    labels: torch.Tensor  # [B, S] int64 on the device, already shifted (position t predicts t + 1)
    n_tokens: torch.Tensor  # [] int64 on the device: tokens predicted in the whole batch
    micro: list[slice]  # rows of each micro-batch, in order


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
    ) -> None:
        self.templates, self.store, self.plan = templates, store, plan
        self.config = templates.config
        self.compute_dtype, self.device = compute_dtype, device
        self.max_grad_norm = max_grad_norm
        self.eager = plan.optimizer_mode == "eager"
        self.log = log
        self.streams = Streams(device)
        self.timer = StepTimer(self.streams.cuda)
        pin = device.type == "cuda"
        blocks = templates.blocks
        self.slots = WeightSlots(plan.num_slots, store.max_block_numel, compute_dtype, device, self.streams)
        self.grad_buffers = GradBuffers(plan.device_grad_buffers, store.max_block_numel, device, self.streams, self.timer)
        self.tied = self.config.tie_word_embeddings
        # Tied embeddings: the head's lm_head gradient lands here in forward and the embedding's
        # own in backward; one extra fp32 buffer of the embedding's size, resident for the whole step.
        self.tied_grad = (torch.zeros(templates.embed.layout.numel, dtype=torch.float32, device=device)
                          if self.tied else None)
        self.tied_drained: Event = self.streams.event()
        self.checkpoints: DeviceCheckpoints | HostCheckpoints = (
            HostCheckpoints(plan.num_slots, compute_dtype, device, self.streams, pin, self.timer)
            if plan.checkpoints == "host" else DeviceCheckpoints()
        )
        self.adam = AdamWorker(store, len(blocks), log)
        self.step_no = 0  # optimizer steps completed or in flight
        self.loader = WeightLoader(self.slots, store, self.streams, plan.prefetch_depth,
                                   lambda b: self.adam.wait_updated(b, self.step_no - 1), log, self.timer)
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
        self.inv_freq = inverse_frequencies(self.config)
        self._rope: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ the step
    def train_step(self, batch: Batch, hyper: AdamHyper) -> torch.Tensor:
        """One optimizer step over ``batch``; returns the mean loss as a device scalar (no sync)."""
        self.step_no += 1
        step = self.step_no
        self.timer.begin(self.streams.compute)
        blocks = self.templates.blocks
        embed, head, layers = self.templates.embed, self.templates.head, self.templates.layers
        cos, sin = self._rotary(batch.input_ids.shape[1])
        b_size, seq = batch.input_ids.shape
        self.checkpoints.begin(len(layers), b_size, seq, self.config.hidden_size)

        fwd = [(embed.index, "fwd")] + [(l.index, "fwd") for l in layers] + [(head.index, "fwd")]
        if self.tied:
            fwd.append((embed.index, "fwd"))
        bwd = [(l.index, "bwd") for l in reversed(layers)]
        saved_layers = [0]  # forward layers whose checkpoints are all saved
        n_fwd = len(fwd)
        self.loader.start(step, fwd + bwd, on_load=self._load_checkpoints(n_fwd),
                          can_issue=lambda j: j < n_fwd or saved_layers[0] == len(layers))
        pending: list[tuple[Block, torch.Tensor | None, Event, Callable[[], None] | None]] = []  # deferred-mode jobs
        j = 0

        # ---- forward: embedding, then each layer (saving its inputs)
        params = embed.layout.views(self.loader.acquire(j))
        with torch.no_grad(), record_function(f"fwd[{embed.index}]"):
            x = [self.templates.run(BlockKind.EMBED, params, batch.input_ids[rows]) for rows in batch.micro]
        self.loader.release(j)
        j += 1
        with torch.no_grad():
            for layer in layers:
                params = layer.layout.views(self.loader.acquire(j))
                with record_function(f"fwd[{layer.index}]"):
                    for m, rows in enumerate(batch.micro):
                        self.checkpoints.save(layer.layer, m, rows, x[m])  # type: ignore[arg-type]
                        x[m] = self.templates.run(BlockKind.LAYER, params, x[m], cos, sin)
                saved_layers[0] += 1
                self.loader.release(j)
                self.checkpoints.end_forward_block()
                j += 1
        self.checkpoints.flush()

        # ---- head: loss and its gradient at once, chunk by chunk
        j_head = j
        head_params = head.layout.views(self.loader.acquire(j_head))
        j += 1
        g_index, g_buf = self.grad_buffers.acquire(head.layout.numel)
        g_views = head.layout.views(g_buf)
        if self.tied:
            j_embed = j
            lm_weight = embed.layout.views(self.loader.acquire(j_embed))["embed_tokens.weight"]
            j += 1
            self.timer.wait("d2h", self.tied_drained, self.streams.compute)
            self.tied_grad.zero_()  # type: ignore[union-attr]
            lm_grad = embed.layout.views(self.tied_grad)["embed_tokens.weight"]  # type: ignore[arg-type]
        else:
            lm_weight, lm_grad = head_params["lm_head.weight"], g_views["lm_head.weight"]
        norm_params = {k: v for k, v in head_params.items() if k.startswith("norm.")}
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        dy: list[torch.Tensor] = []
        with record_function(f"head[{head.index}]"):
            for m, rows in enumerate(batch.micro):
                out = head_forward_backward(
                    lambda p, h: self.templates.run(BlockKind.HEAD, {**head_params, **p}, h), norm_params, lm_weight,
                    x[m], batch.labels[rows], batch.n_tokens, self.plan.loss_chunk_tokens, lm_grad,
                )
                loss = loss + out.loss
                dy.append(out.dx)
                for name, g in out.norm.items():
                    g_views[name].add_(g)
        del x
        self.loader.release(j_head)
        if self.tied:
            self.loader.release(j_embed)
        pending += self._finish_block(step, head, g_index, g_buf, hyper)

        # ---- backward: recompute each layer from its checkpoint, backprop dy
        for layer in reversed(layers):
            slot = j % len(self.slots)
            params = layer.layout.views(self.loader.acquire(j))
            g_index, g_buf = self.grad_buffers.acquire(layer.layout.numel)
            g_list = layer.layout.view_list(g_buf)
            with record_function(f"bwd[{layer.index}]"):
                for m, rows in enumerate(batch.micro):
                    x_in = self.checkpoints.get(layer.layer, m, rows, slot).detach().requires_grad_()  # type: ignore[arg-type]
                    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
                    with torch.enable_grad():
                        out = self.templates.run(BlockKind.LAYER, leaves, x_in, cos, sin)
                    grads = torch.autograd.grad(out, (x_in, *leaves.values()), dy[m])
                    dy[m] = grads[0]
                    by_name = dict(zip(leaves.keys(), grads[1:]))
                    torch._foreach_add_(g_list, [by_name[e.local_name] for e in layer.layout.entries])
            self.loader.release(j)
            j += 1
            pending += self._finish_block(step, layer, g_index, g_buf, hyper)

        # ---- embedding backward: a scatter-add of dy into the rows used; no weights needed
        if self.tied:
            g_index, g_buf = None, self.tied_grad
        else:
            g_index, g_buf = self.grad_buffers.acquire(embed.layout.numel)
        table = embed.layout.views(g_buf)["embed_tokens.weight"]  # type: ignore[arg-type]
        pad = -1 if self.config.pad_token_id is None else self.config.pad_token_id
        with record_function(f"bwd[{embed.index}]"):
            for m, rows in enumerate(batch.micro):
                table.add_(torch.ops.aten.embedding_dense_backward(
                    dy[m], batch.input_ids[rows], self.config.vocab_size, pad, False))
        del dy
        pending += self._finish_block(step, embed, g_index, g_buf, hyper)  # type: ignore[arg-type]

        # ---- global norm, clip coefficient, and the deferred updates in forward order
        self.grad_norm = torch.linalg.vector_norm(self.norms, 2.0)
        clip = None
        if self.max_grad_norm is not None:
            self.timer.wait("d2h", self.clip_copied, self.streams.compute)
            self.clip_dev.copy_(torch.clamp(self.max_grad_norm / (self.grad_norm + 1e-6), max=1.0))
            self.clip_copied = self._drain_scalar(self.clip_dev, self.clip_host)
            clip = (self.clip_host, self.clip_copied)
        for block, host, done, release in sorted(pending, key=lambda p: p[0].index):
            self._submit(step, block, host, done, clip, hyper, release)
        self.timer.end(self.streams.compute)
        return loss

    def _finish_block(
        self, step: int, block: Block, g_index: int | None, g_buf: torch.Tensor, hyper: AdamHyper
    ) -> list[tuple[Block, torch.Tensor | None, Event, Callable[[], None] | None]]:
        """Record the block's gradient norms, drain its grads to the host, queue (eager) its update."""
        norms = torch._foreach_norm(block.layout.view_list(g_buf), 2.0)
        self.norms.index_copy_(0, self.norm_index[block.index], torch.stack(norms))
        with self.timer.host("adam"):  # waits only while every eager-mode slab awaits its update
            sink = self.store.grad_sink(block.index, check=self.adam.raise_if_failed)
        with record_function(f"d2h[{block.index}]"):
            done = self.grad_buffers.drain(g_index, g_buf, sink.host)
        if g_index is None:
            self.tied_drained = done
        self.log.record("d2h", step, block.index)
        sink.on_drained(done)
        if sink.for_adam is None:  # spilled grads: AdamW reads the block back from the grads file
            return [(block, None, self.streams.event(), None)]
        if self.eager:
            self._submit(step, block, sink.for_adam, done, None, hyper, sink.release)
            return []
        return [(block, sink.for_adam, done, sink.release)]

    def _submit(self, step: int, block: Block, host: torch.Tensor | None, done: Event,
                clip: tuple[torch.Tensor, Event] | None, hyper: AdamHyper, release: Callable[[], None] | None) -> None:
        self.log.record("adam_submit", step, block.index)
        self.adam.submit(AdamJob(step, block.index, host, done, clip, hyper, block.layout, release))

    def _drain_scalar(self, value: torch.Tensor, host: torch.Tensor) -> Event:
        ready = self.streams.recorded(self.streams.compute)
        with self.streams.d2h.use():
            ready.wait_on(self.streams.d2h)
            host.copy_(value, non_blocking=True)
            return self.streams.recorded(self.streams.d2h)

    def _load_checkpoints(self, first_backward_load: int):
        def on_load(j: int, block: int, slot: int) -> None:
            if j >= first_backward_load:
                layer = self.templates.blocks[block].layer
                assert layer is not None
                self.checkpoints.load_into_slot(layer, slot)
        return on_load

    def _rotary(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq, self.compute_dtype)
        if key not in self._rope:
            self._rope[key] = rotary_tables(self.inv_freq, seq, self.device, self.compute_dtype)
        return self._rope[key]

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, S] on the device -> logits [B, S, vocab] fp32 (materialised: for evaluation)."""
        self.adam.wait_all(self.step_no)
        embed, head, layers = self.templates.embed, self.templates.head, self.templates.layers
        cos, sin = self._rotary(input_ids.shape[1])
        seq = [(embed.index, "fwd")] + [(l.index, "fwd") for l in layers] + [(head.index, "fwd")]
        if self.tied:
            seq.append((embed.index, "fwd"))
        self.loader.start(self.step_no, seq)
        x = self.templates.run(BlockKind.EMBED, embed.layout.views(self.loader.acquire(0)), input_ids)
        self.loader.release(0)
        for j, layer in enumerate(layers, start=1):
            x = self.templates.run(BlockKind.LAYER, layer.layout.views(self.loader.acquire(j)), x, cos, sin)
            self.loader.release(j)
        j = len(layers) + 1
        head_params = head.layout.views(self.loader.acquire(j))
        normed = self.templates.run(BlockKind.HEAD, head_params, x)
        if self.tied:
            weight = embed.layout.views(self.loader.acquire(j + 1))["embed_tokens.weight"]
        else:
            weight = head_params["lm_head.weight"]
        flat = normed.reshape(-1, normed.shape[-1])
        logits = chunked_logits(flat, weight, self.plan.loss_chunk_tokens).float()
        self.loader.release(j)
        if self.tied:
            self.loader.release(j + 1)
        return logits.view(*input_ids.shape, -1)

    def close(self) -> None:
        self.adam.close()
        if isinstance(self.checkpoints, HostCheckpoints):
            self.checkpoints.close()
