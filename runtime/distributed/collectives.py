"""The collectives of a data-parallel step, on a communication stream with events.

[Note: collectives]
Per block, with W ranks (shard layout: shards.py, [Note: shards]):

- load: the rank's compute-dtype shadow shard is copied H2D into its place in
  the slot (h2d stream), then the slot is all-gathered in place
  (``all_gather_into_tensor``) on the comm stream; the h2d stream waits for the
  gather, so the slot's ``loaded`` event covers it and the loader's prefetch
  depth covers the gather as it covers the copy.
- gradient: after the block's micro-batches, its fp32 gradient (padded to W
  shards) is reduce-scattered with SUM into this rank's device shard buffer on
  the comm stream (after the compute that wrote it), the shard's sum of squares
  is added to a device accumulator there, and the D2H drain waits for that
  (``ready``). SUM is the average over the global batch: every rank's loss is
  already divided by the global count of predicted tokens (``all_reduce_sum``
  of the per-rank counts at the start of the step), as one process divides the
  whole batch's loss.
- global norm: one all-reduce of the per-rank partial sums of squares.

Collectives are issued from the training thread only, in the same order on
every rank (the load sequence and the backward are the same everywhere). No
host sync: on CUDA every wait is ``stream.wait_event`` (NCCL collectives are
issued on the comm stream and only order streams); on a CPU the streams are
no-ops and gloo runs each collective when issued. A shard buffer is reused by
the gradient buffer of the same index, after that buffer's ``drained`` event.
Device memory: (grad buffers + 1) x largest shard x 4 bytes.

[Note: collectives in place on gloo]
gloo's ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` allocate a
temporary the size of the whole padded block per call (measured: +64 MiB of
peak RSS per call on a 64 MiB block; the reduce-scatter is an all-reduce of a
copy of the input). On CPU ranks (gloo) these are the rank's memory too, so
there: the slot is gathered by W broadcasts, rank r's shard from rank r into
its place in the slot (in place, the same bytes received); the gradient is
all-reduced in place in its device buffer, which nothing reads afterwards, and
the rank's shard is a view of it (bitwise what the reduce-scatter gives, which
reduces the same way), so no shard buffers either. Extra memory of a CPU
rank's collectives: none. NCCL keeps the single collectives and the shard
buffers (its temporaries are its own, on the device).
"""
from __future__ import annotations

import datetime
from typing import Callable

import torch
import torch.distributed as dist

from megatrain.runtime.distributed.process_group import Topology
from megatrain.runtime.state.shards import Shards
from megatrain.runtime.device.streams import Event, Stream, Streams
from megatrain.runtime.model.templates import Block


class Collectives:
    def __init__(self, topology: Topology, blocks: tuple[Block, ...], device: torch.device, grad_buffers: int) -> None:
        """The collectives of this rank (``topology``) over ``blocks``; ``grad_buffers``: the plan's device
        gradient buffers. ``streams`` are the step's (the executor takes them from here)."""
        self.topology = topology
        self.shards = Shards.of(blocks, topology.rank, topology.world_size)
        self.streams = streams = Streams(device)
        shards = self.shards
        self.comm = Stream(torch.cuda.Stream(device)) if streams.cuda else streams.compute
        self.in_place = topology.backend == "gloo"  # [Note: collectives in place on gloo]
        largest = max(shards.numel(b.index) for b in shards.blocks)
        # One shard buffer per device gradient buffer, plus one for a tied embedding's (index None); none on gloo.
        self.grad_shards = [] if self.in_place else [
            torch.zeros(largest, dtype=torch.float32, device=device) for _ in range(grad_buffers + 1)]
        self.norm_sq = torch.zeros((), dtype=torch.float32, device=device)  # this rank's sum of squared grads

    # ---- per step ---------------------------------------------------------------------
    def begin_step(self) -> None:
        with self.comm.use():
            self.comm.wait_event(self.streams.recorded(self.streams.compute))
            self.norm_sq.zero_()

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``value`` (a device tensor written on the compute stream), for the compute stream."""
        out = value.clone()
        with self.comm.use():
            self.comm.wait_event(self.streams.recorded(self.streams.compute))
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
            done = self.streams.recorded(self.comm)
        self.streams.compute.wait_event(done)
        return out

    def global_norm(self) -> torch.Tensor:
        """The global gradient norm: sqrt of the all-reduced partial sums of squares (for the compute stream)."""
        with self.comm.use():
            total = self.norm_sq.clone()
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            done = self.streams.recorded(self.comm)
        self.streams.compute.wait_event(done)
        return total.sqrt()

    # ---- per block ----------------------------------------------------------------------
    def fill_slot(self, block: int, slot: torch.Tensor, place: Callable[[torch.Tensor], None]) -> None:
        """On the h2d stream: ``place`` writes this rank's shard into its place in ``slot`` (the shadow shard's
        copy, or the master's read from its spill file), then the whole block is gathered into ``slot`` from
        every rank; later h2d work (the ``loaded`` event) follows the gather."""
        own = self.shards.own(block)
        place(slot[own])
        copied = self.streams.recorded(self.streams.h2d)
        with self.comm.use():
            self.comm.wait_event(copied)
            self._gather(block, slot)
            gathered = self.streams.recorded(self.comm)
        self.streams.h2d.wait_event(gathered)

    def reduce_scatter(self, block: int, index: int | None, grads: torch.Tensor) -> tuple[torch.Tensor, Event]:
        """Block's gradient ``grads`` ([padded] fp32, written on the compute stream) summed over ranks; returns this
        rank's shard (a device buffer reused after the drain of gradient buffer ``index``; on gloo a view of ``grads``,
        all-reduced in place) and its ready event.
        The shard's sum of squares goes into the rank's partial norm."""
        n = self.shards.numel(block)
        with self.comm.use():
            self.comm.wait_event(self.streams.recorded(self.streams.compute))
            if self.in_place:
                dist.all_reduce(grads, op=dist.ReduceOp.SUM)
                shard = grads[self.shards.own(block)]
            else:
                shard = self.grad_shards[-1 if index is None else index][:n]
                _reduce_scatter(shard, grads, op=dist.ReduceOp.SUM)
            self.norm_sq.add_(torch.dot(shard, shard))
            ready = self.streams.recorded(self.comm)
        return shard, ready

    # ---- whole blocks on the host (state dicts, checkpoints, export) ------------------------------
    def gather_host(self, block: int, shard: torch.Tensor) -> torch.Tensor:
        """Block's whole flat fp32 layout ([numel]) from every rank's host ``shard``, on every rank."""
        padded = self.shards.padded(block)
        device = torch.device("cpu") if self.in_place else self.norm_sq.device
        out = torch.empty(padded, dtype=shard.dtype, device=device)
        if self.in_place:
            out[self.shards.own(block)] = shard
            self._gather(block, out)
        else:
            _all_gather(out, shard.to(device))
        return out[:self.shards.full[block].layout.numel].cpu()

    def _gather(self, block: int, whole: torch.Tensor) -> None:
        """Every rank's shard of ``block`` into its place in ``whole`` (this rank's already there): one
        all-gather, or on gloo one broadcast per rank, in place ([Note: collectives in place on gloo])."""
        own, s = self.shards.own(block), self.shards.numel(block)
        if not self.in_place:
            _all_gather(whole[:self.shards.padded(block)], whole[own])
            return
        for r in range(self.shards.world_size):
            dist.broadcast(whole[r * s:(r + 1) * s], src=r)

    def barrier(self) -> None:
        dist.barrier()


def set_timeout(seconds: float) -> bool:
    """Every later collective of this process's group waits at most ``seconds`` for the other ranks (gloo raises;
    NCCL's watchdog aborts), instead of the timeout the group was made with. False where this torch has no setter
    (the group keeps its timeout)."""
    from torch.distributed import distributed_c10d

    setter = getattr(distributed_c10d, "_set_pg_timeout", None)  # torch's own (private: no public one yet)
    if setter is None:
        return False
    setter(datetime.timedelta(seconds=seconds))
    return True


# torch renamed these two (same arguments); the older names warn where the new ones exist.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
