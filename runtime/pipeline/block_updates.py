"""A block's gradient once the step has computed it: its norms, its drain to the host, its AdamW update.

Each finished block records its per-parameter gradient norms into one device vector (no host sync; data
parallel: its gradient is reduce-scattered instead, [Note: collectives]) and drains from the device buffer
into the host sinks the store gives it. Eager mode submits the block's update at once; deferred mode keeps
it pending until backward is done, then submits every block's in forward order with the clip coefficient
computed from the global norm, as ``clip_grad_norm_`` does ([Note: block-major step]).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch.profiler import record_function

from megatrain.runtime.device.event_log import EventLog
from megatrain.runtime.device.streams import Event, Streams
from megatrain.runtime.distributed.collectives import Collectives
from megatrain.runtime.model.templates import Block, Templates
from megatrain.runtime.optim.adamw_kernel import AdamHyper
from megatrain.runtime.optim.block_optimizer import BlockOptimizer, Clip
from megatrain.runtime.pipeline.grad_buffers import GradBuffers
from megatrain.runtime.pipeline.step_timer import StepTimer
from megatrain.runtime.state.host_store import GradSink, HostStore


class PendingUpdate(NamedTuple):
    """A deferred-mode block update: submitted after backward, in forward order, with the clip coefficient."""
    block: Block
    grads: torch.Tensor | None  # fp32 host [numel] the drain writes; None: AdamW reads them from the grads file
    grads_ready: Event  # the drain's completion
    release: Callable[[], None] | None  # gives the grads' host slab back once AdamW has read it (eager / spilled)


class BlockUpdates:
    def __init__(self, templates: Templates, store: HostStore, optim: BlockOptimizer, grad_buffers: GradBuffers,
                 streams: Streams, timer: StepTimer, log: EventLog, eager: bool, max_grad_norm: float | None,
                 device: torch.device, collectives: Collectives | None) -> None:
        self.store, self.optim, self.grad_buffers = store, optim, grad_buffers
        self.streams, self.timer, self.log = streams, timer, log
        self.eager, self.max_grad_norm = eager, max_grad_norm
        self.dist = collectives
        blocks = templates.blocks
        order = {name: i for i, name in enumerate(templates.hf_parameter_order())}
        self.norm_index = [torch.tensor([order[e.hf_name] for e in b.layout.entries], device=device) for b in blocks]
        # Per-parameter gradient norms in model.parameters() order, filled as blocks finish.
        self.norms = torch.zeros(len(order), dtype=torch.float32, device=device)
        # The clip coefficient: a device scalar of its own (a temporary could be reused by the allocator
        # before its D2H ran), copied to (pinned) host memory for the AdamW worker; rewritten only after
        # the compute stream waited for the previous copy.
        self.clip_dev = torch.zeros((), dtype=torch.float32, device=device)
        self.clip_host = torch.zeros((), dtype=torch.float32, pin_memory=device.type == "cuda")
        self.clip_copied: Event = self.streams.event()
        self.grad_norm: torch.Tensor | None = None  # the last step's global norm, before clipping
        self.tied_drained: Event = self.streams.event()  # the drain of the buffer that is no pool's (tied)

    def finish(self, step: int, block: Block, g_index: int | None, g_buf: torch.Tensor,
               hyper: AdamHyper) -> list[PendingUpdate]:
        """Record the block's gradient norms, drain its grads to the host, queue (eager) its update.
        Data parallel: the drain is of this rank's shard of the gradient summed over ranks."""
        reduced: Event | None = None
        if self.dist is None:
            norms = torch._foreach_norm(block.layout.view_list(g_buf), 2.0)
            self.record_norms(block, torch.stack(norms))
        else:
            g_buf, reduced = self.dist.reduce_scatter(block.index, g_index, g_buf)
        # One sink per piece: the whole block in RAM; a chunk at a time when the gradients spill.
        sinks = iter(self.store.grad_sinks(block.index, check=self.optim.raise_if_failed))
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
        return self.hand_off(step, block, sink, done, hyper)

    def record_norms(self, block: Block, norms: torch.Tensor) -> None:
        """Block's per-parameter gradient norms ([entries] fp32, in its layout's order) into the step's vector."""
        self.norms.index_copy_(0, self.norm_index[block.index], norms)

    def grad_sink(self, block: Block) -> GradSink:
        """Block's one host gradient sink (its gradients in RAM; eager mode: a slab, waited for while every slab
        awaits its update, the wait timed as AdamW's): a layer streamed in parts drains into it part by part
        (experts/expert_layers.py)."""
        with self.timer.adam_wait(self.streams.compute):
            return self.store.grad_sink(block.index, check=self.optim.raise_if_failed)

    def hand_off(self, step: int, block: Block, sink: GradSink, done: Event, hyper: AdamHyper) -> list[PendingUpdate]:
        """Block's gradient has drained into ``sink`` (``done``: its last drain): its update queued (eager) or
        kept pending. The end of ``finish``; a layer streamed in parts drains part by part first
        (experts/expert_layers.py)."""
        self.log.record("d2h", step, block.index)
        if sink.for_adam is None:  # spilled grads: AdamW reads the block back from the grads file
            return [PendingUpdate(block, None, self.streams.event(), None)]
        if self.eager:
            self._submit(step, block, sink.for_adam, done, None, hyper, sink.release)
            return []
        return [PendingUpdate(block, sink.for_adam, done, sink.release)]

    def submit_pending(self, step: int, pending: list[PendingUpdate], hyper: AdamHyper) -> None:
        """The global norm, the clip coefficient, and the deferred updates in forward order."""
        clip = self._clip_coefficient()
        for update in sorted(pending, key=lambda u: u.block.index):
            self._submit(step, update.block, update.grads, update.grads_ready, clip, hyper, update.release)

    def _clip_coefficient(self) -> Clip | None:
        """The global norm (``grad_norm``) and, with clipping, the coefficient on its way to the host."""
        self.grad_norm = torch.linalg.vector_norm(self.norms, 2.0) if self.dist is None else self.dist.global_norm()
        if self.max_grad_norm is None:
            return None
        with self.timer.stall("d2h", self.streams.compute):
            self.streams.compute.wait_event(self.clip_copied)
        self.clip_dev.copy_(torch.clamp(self.max_grad_norm / (self.grad_norm + 1e-6), max=1.0))
        self.clip_copied = self._drain_scalar(self.clip_dev, self.clip_host)
        return Clip(self.clip_host, self.clip_copied, self.clip_dev)

    def _submit(self, step: int, block: Block, host: torch.Tensor | None, done: Event,
                clip: Clip | None, hyper: AdamHyper, release: Callable[[], None] | None) -> None:
        if not self.optim.inline:
            self.optim.submit(step, block.index, host, done, clip, hyper, release)
            return
        with self.timer.adam_wait(self.streams.compute):  # the update runs here, on the compute thread: exposed
            self.optim.submit(step, block.index, host, done, clip, hyper, release)

    def _drain_scalar(self, value: torch.Tensor, host: torch.Tensor) -> Event:
        ready = self.streams.recorded(self.streams.compute)
        with self.streams.d2h.use():
            self.streams.d2h.wait_event(ready)
            host.copy_(value, non_blocking=True)
            return self.streams.recorded(self.streams.d2h)
