"""A spilled step without a GPU: the disk as a resource beside the CPU in each half of the step, as the runtime
schedules it ([Note: spill read-ahead] in runtime/spill/read_ahead.py). Pure stdlib.

The CPU runs the step's compute, its copies and AdamW's arithmetic one after another (they share the cores:
``cpu`` below, the replay's sum). The disk runs beside them, and the step waits on it only where the work it
must finish first is longer than the CPU work it overlaps. Deferred mode (``cpu_step``):

  backward   the loads of the layers whose master spills (layer x 4 bytes each, read), the drains of the
             spilled gradients (written), and the read-ahead: the next update's first chunks' master, m and v
             (those that spill) in update order, at most ``spill_staging`` chunks (one staging set each), and
             no more than the disk can read in the backward's CPU time beside the loads and drains:
               ahead <= max(0, B - loads_b / R - grads / W) x R        (B: the backward's CPU seconds)
             exposed_b = max(0, loads_b / R + grads / W + ahead / R - B)
  forward    AdamW updates block i (forward order) before the forward loads it: its spilled kinds read (less
             what was read ahead), its master, m and v written behind; the load takes a spilled master from
             the update's writes (the runtime's tap, [Note: spilled loads]: a host copy, as a load from RAM),
             and only a tied head's re-load of the embedding reads the disk (load_i); the disk does that block
             after block while the CPU computes the blocks already updated:
               a_i = a_{i-1} + (reads_i - ahead_i) / R + writes_i / W + load_i / R
               e_i = max(e_{i-1}, a_i) + f_i        (f_i: block i's forward CPU seconds, e_{-1} = a_{-1} = 0)
             exposed_f = e_last - sum f_i

  step = sum over visits of (load + compute + drain) + AdamW arithmetic + exposed_f + exposed_b

Eager mode (``eager_step``: each block's update as soon as its gradients are whole, so both halves carry I/O;
no gradient spills): the disk serves its work in the order it is issued, one queue (d: when it is free; c: the
CPU's clock). Forward: each block's spilled master read ahead of its compute, d += load_i / R,
c = max(c, d) + f_i, the head's update after its backward: its update u_head = reads / R + writes / W of its
spilled master, m and v. Backward, each visit j (the layers in reverse, then the embedding, which loads nothing):
its load, issued while the previous block computed, d += load_j / R; its compute starts at s_j = max(c, d);
the previous block's update, issued when that block's compute ended, d = max(d, c) + u_prev; then
c = s_j + cpu_j + a_j (a_j: block j's AdamW arithmetic, on the same cores; the head's with the first layer's).
The last update follows the last compute: step = max(c, max(d, c) + u_embedding). The read-ahead
([Note: spill read-ahead]): wherever the disk would idle before the CPU's clock, less the load the loader issues
next (the loads go first), it reads the next updates' master, m and v in update order (the head's, the layers'
in reverse, the embedding's), at most what the staging sets hold (``staging_bytes``: sets x the largest chunk's
set) beyond what their updates took; an update's u then counts only its reads not read ahead. Before each
backward load of a layer the read-ahead has also reached that layer's update as far as the sets hold, idle disk
or not (d += those reads / R): the runtime's read-ahead, into the sets free in backward whether the disk is busy
or not, stays ahead of the loads (the 3.2B shape's eager step with 64 sets read 47.8-50.9 GB a step, its backward
loads nearly all lent: 51.9-52.2 GB planned, 58.5-59.6 before this term, and the step +5% to +14% against +15% to
+24%).

Both modes add k x the bytes each disk transfer moves to the CPU work it runs beside (k: the profile's
``disk_cpu_s_per_gb``, planner/disk_contention.py: the kernel's share of spill I/O, on the compute's cores).

R, W: the profile's disk read and write GB/s. Backward's loads of blocks whose master spills read the disk
straight into the slot (no host copy: their load is 0 on the CPU side), but for the chunks of the block's update
read ahead by then, which the load copies from the staging sets at the host copy rate instead (the runtime's
[Note: lent masters]): eager, every load whose block the read-ahead has reached in update order (most of
backward's; the forward's read-ahead still leaves room for the next load whole, a bound on what it gets);
deferred, the layers among the next update's first blocks (backward's last loads). The cost model adds the floor
every spill plan has (``step >= disk bytes / GB/s``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatrain.planner.costs import spill_placement
from megatrain.plan.buffer_kinds import BufferKind, spill_chunks
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.plan.plan import Plan
from megatrain.planner.costs.step_replay import BlockVisit

UPDATED = (BufferKind.MASTER, BufferKind.EXP_AVG, BufferKind.EXP_AVG_SQ)  # what AdamW reads ahead and writes back


@dataclass(frozen=True)
class SpillStep:
    """The spilled step's timing on the CPU (seconds; bytes of the read-ahead)."""

    forward_s: float          # end of the forward half (the head's loss and backward included; AdamW's arithmetic
                              # counts with the backward half, as the cost model's other CPU steps count it)
    step_s: float
    forward_exposed_s: float  # the CPU waited on the disk in the forward half (AdamW's I/O and the loads)
    backward_exposed_s: float
    read_ahead_bytes: float   # the updates' master, m and v read ahead (deferred: during backward)
    eager: bool = False
    lent_bytes: float = 0.0   # master bytes loads copied from the staging sets instead of reading them from disk

    @property
    def update_exposed_s(self) -> float:
        """What the updates' disk work added to the step: in the forward half (deferred), or after the
        backward's compute (eager)."""
        return self.backward_exposed_s if self.eager else self.forward_exposed_s


def applies(hw: HardwareProfile, plan: Plan, spilled: "spill_placement.Spilled") -> bool:
    """This model times the step: no GPU, something on disk (deferred: ``cpu_step``; eager: ``eager_step``)."""
    return hw.device_is_host and bool(spilled.kinds)


def tapped(hw: HardwareProfile, plan: Plan) -> bool:
    """A forward load of a block whose master spills takes it from its update's writes, not from the disk: the
    runtime taps the update where the device is the CPU and updates are deferred ([Note: spilled loads])."""
    return hw.device_is_host and plan.optimizer_mode == "deferred"


def read_ahead(spilled: "spill_placement.Spilled", chunk_bytes: int, sets: int, budget: float) -> list[float]:
    """Bytes of each block read ahead: the blocks in update order (forward order), each chunk
    (``buffer_kinds.spill_chunks``, as the runtime cuts them) of a block whose master, m or v spills one
    staging set (piece x the sum of s_k over those kinds), at most ``sets`` chunks and ``budget`` bytes in all."""
    out = [0.0] * len(spilled.numels)
    for b, numel in enumerate(spilled.numels):
        per_element = spilled.disk_bytes_per_element(b, UPDATED)
        for _, piece in (spill_chunks(numel, chunk_bytes) if per_element else ()):
            if sets <= 0 or budget <= 0:
                return out
            nbytes = min(budget, piece * float(per_element))
            out[b] += nbytes
            budget -= nbytes
            sets -= 1
    return out


def cpu_step(spilled: "spill_placement.Spilled", plan: Plan, hw: HardwareProfile, steps: Sequence[BlockVisit],
             n_fwd: int, adam_cpu_s: float, tied: bool, compute_bytes: int) -> SpillStep:
    """The step (see the module docstring). ``steps``: the forward's visits (the embedding, the layers, the head:
    block i at visit i), then the backward's (the layers in reverse, the embedding); ``adam_cpu_s``: AdamW's
    arithmetic for every block. Eager plans: ``eager_step``."""
    if plan.optimizer_mode == "eager":
        return eager_step(spilled, hw, steps, n_fwd, adam_cpu_s, tied, compute_bytes,
                          staging_bytes(spilled, plan.spill_chunk_bytes, plan.spill_staging))
    R, W = hw.disk_read_gbps * 1e9, hw.disk_write_gbps * 1e9
    n = len(spilled.numels)
    on_disk = spilled.blocks.get(BufferKind.MASTER, frozenset()) if compute_bytes == 4 else frozenset()

    def cpu(st: BlockVisit, block: int | None) -> float:  # a spilled master loads from disk: no host copy
        return (0.0 if block in on_disk else st.load_s) + st.compute_s + st.d2h_s

    fwd_blocks = list(range(n))
    bwd_blocks: list[int | None] = [*range(n - 2, 0, -1), None]      # the layers in reverse; the embedding's
    # the forward's loads of a spilled master copy what the update wrote (the tap: host copy GB/s, the H2D
    # figure where the device is the CPU); the embedding's backward loads nothing
    f = [(spilled.numels[b] * 4.0 / (hw.h2d_gbps * 1e9) if b in on_disk else st.load_s) + st.compute_s + st.d2h_s
         for st, b in zip(steps[:n_fwd], fwd_blocks)]
    B = sum(cpu(st, b) for st, b in zip(steps[n_fwd:], bwd_blocks))
    # loads reading the master from disk: forward, only a tied head's re-load of the embedding; backward, each
    # layer once
    fwd_load = [0.0] * n
    if tied and 0 in on_disk:
        fwd_load[n - 1] += spilled.numels[0] * 4.0
    bwd_load = sum(spilled.numels[b] * 4.0 for b in bwd_blocks if b in on_disk)
    grads = sum(spilled.numels[b] * 4.0 for b in spilled.blocks.get(BufferKind.GRADS, ()))
    busy_b = bwd_load / R + grads / W
    ahead = read_ahead(spilled, plan.spill_chunk_bytes, plan.spill_staging, max(0.0, B - busy_b) * R)
    # a layer whose update's first chunks are read ahead (backward loads it last) copies their master from the
    # sets instead of reading it ([Note: lent masters])
    lent = sum(ahead[b] * 4.0 / spilled.disk_bytes_per_element(b, UPDATED) for b in bwd_blocks if b in on_disk)
    bwd_load, busy_b, B = bwd_load - lent, busy_b - lent / R, B + lent / (hw.h2d_gbps * 1e9)
    k = hw.disk_cpu_s_per_gb / 1e9  # the CPU's share of each byte the disk moves, on the same cores
    B += k * (bwd_load + grads + sum(ahead))
    exposed_b = max(0.0, busy_b + sum(ahead) / R - B)
    a = e = f_cpu = 0.0
    for b in fwd_blocks:
        reads = spilled.block_disk_bytes(b) - ahead[b]
        writes = float(spilled.block_disk_bytes(b, UPDATED))
        a += reads / R + writes / W + fwd_load[b] / R
        work = f[b] + k * (reads + writes + fwd_load[b])
        e, f_cpu = max(e, a) + work, f_cpu + work
    return SpillStep(e, e + B + exposed_b + adam_cpu_s, e - f_cpu, exposed_b, sum(ahead), lent_bytes=lent)


def eager_step(spilled: "spill_placement.Spilled", hw: HardwareProfile, steps: Sequence[BlockVisit], n_fwd: int,
               adam_cpu_s: float, tied: bool, compute_bytes: int, staging_bytes: float = 0.0) -> SpillStep:
    """Eager mode's step (the module docstring): ``steps`` and ``adam_cpu_s`` as for ``cpu_step``; the AdamW
    arithmetic is shared out over the blocks by their elements; ``staging_bytes``: what the staging sets hold, the
    bound of the read-ahead."""
    R, W = hw.disk_read_gbps * 1e9, hw.disk_write_gbps * 1e9
    numels = spilled.numels
    n = len(numels)
    on_disk = spilled.blocks.get(BufferKind.MASTER, frozenset()) if compute_bytes == 4 else frozenset()
    per_element = adam_cpu_s / max(1, sum(numels))
    reads = [float(spilled.block_disk_bytes(b)) for b in range(n)]        # an update's: its spilled master, m, v
    writes = [float(spilled.block_disk_bytes(b, UPDATED)) for b in range(n)]
    total = sum(reads)
    ahead = taken = read_ahead_bytes = 0.0  # bytes of the updates' reads, in update order: read ahead, taken
    lent_bytes = 0.0  # loads' master bytes copied from the staging sets

    def cpu(st: BlockVisit, block: int) -> float:  # a spilled master is read by the loader: no host copy
        return (0.0 if block in on_disk else st.load_s) + st.compute_s + st.d2h_s

    def fill(d: float, until: float) -> tuple[float, float]:
        """The disk idle from d to ``until`` reads the next updates' master, m and v ahead, within the sets."""
        nonlocal ahead, read_ahead_bytes
        room = min((until - d) * R, staging_bytes - (ahead - taken), total - ahead)
        if room <= 0:
            return d, 0.0
        ahead, read_ahead_bytes = ahead + room, read_ahead_bytes + room
        return d + room / R, room

    def take(b: int) -> tuple[float, float]:
        """Block b's update: the disk seconds and bytes of its reads not read ahead, then its writes."""
        nonlocal ahead, taken
        rest = max(0.0, taken + reads[b] - ahead)
        taken += reads[b]
        ahead = max(ahead, taken)
        return rest / R + writes[b] / W, rest + writes[b]

    k = hw.disk_cpu_s_per_gb / 1e9  # the CPU's share of each byte the disk moves, beside the compute it slows
    H = hw.h2d_gbps * 1e9  # a host copy (where the device is the CPU, its "H2D" figure)
    load_bytes = [numels[b] * 4.0 if b in on_disk else 0.0 for b in range(n)]
    if tied and 0 in on_disk:  # a tied head loads the embedding's table again
        load_bytes[n - 1] += numels[0] * 4.0
    loads = [x / R for x in load_bytes]
    bwd_blocks = [*range(n - 2, 0, -1), 0]
    first = [0.0] * n  # each block's first byte in the updates' reads, in update order
    for prev, b in zip([n - 1, *bwd_blocks], bwd_blocks):
        first[b] = first[prev] + reads[prev]

    def load(blocks: Sequence[int]) -> tuple[float, float]:
        """Masters loaded now: the bytes read from disk, and those copied from the staging sets instead (the
        chunks of their update read ahead so far: the runtime's [Note: lent masters])."""
        disk = lent = 0.0
        for b in (b for b in blocks if b in on_disk):
            f = min(1.0, max(0.0, (ahead - first[b]) / reads[b])) if reads[b] else 0.0
            disk, lent = disk + (1 - f) * numels[b] * 4.0, lent + f * numels[b] * 4.0
        return disk, lent

    next_load = [*loads[1:], loads[bwd_blocks[0]]]  # forward: the load the loader issues during each compute
    c = d = f_cpu = 0.0
    for b, st in zip(range(n), steps[:n_fwd]):
        own, lent = load([b, 0] if tied and b == n - 1 else [b])
        lent_bytes += lent
        d += own / R
        work = cpu(st, b) + k * own + lent / H
        c, f_cpu = max(c, d) + work, f_cpu + work
        d, extra = fill(d, c - next_load[b])  # the loads first: the read-ahead takes the idle time left
        c, f_cpu = c + k * extra, f_cpu + k * extra
    forward_s = c
    (pending, pending_bytes), head_adam = take(n - 1), numels[n - 1] * per_element  # beside the first layer
    b_cpu = 0.0
    bwd_next_load = [load_bytes[b] / R for b in bwd_blocks[1:-1]] + [0.0, 0.0]  # the embedding loads nothing
    for b, st, nxt in zip(bwd_blocks, steps[n_fwd:], bwd_next_load):
        if b and b in on_disk:  # the read-ahead reaches the block before its load, as far as the sets hold
            room = min(first[b] + reads[b] - ahead, staging_bytes - (ahead - taken), total - ahead)
            if room > 0:
                d, ahead, read_ahead_bytes = d + room / R, ahead + room, read_ahead_bytes + room
                c, b_cpu = c + k * room, b_cpu + k * room  # its CPU share is work, as ``fill``'s is
        own, lent = load([b] if b else [])
        lent_bytes += lent
        d += own / R
        start = max(c, d)
        d = max(d, c) + pending
        work = cpu(st, b) + numels[b] * per_element + head_adam + k * (own + pending_bytes) + lent / H
        c, b_cpu, head_adam = start + work, b_cpu + work, 0.0
        d, extra = fill(d, c - nxt)
        c, b_cpu = c + k * extra, b_cpu + k * extra
        pending, pending_bytes = take(b)
    step = max(c, max(d, c) + pending)
    return SpillStep(forward_s, step, forward_s - f_cpu, max(0.0, step - forward_s - b_cpu), read_ahead_bytes,
                     eager=True, lent_bytes=lent_bytes)


def staging_bytes(spilled: "spill_placement.Spilled", chunk_bytes: int, sets: int) -> float:
    """What ``sets`` staging sets hold of the updates' reads: sets x the largest chunk (``buffer_kinds.spill_chunks``)
    x the bytes of its block's spilled master, m and v."""
    largest = 0.0
    for b, numel in enumerate(spilled.numels):
        per_element = spilled.disk_bytes_per_element(b, UPDATED)
        if per_element:
            largest = max(largest, spill_chunks(numel, chunk_bytes)[0][1] * float(per_element))
    return sets * largest
