"""What one training step moves and computes apart from its timing: the bytes it copies between host and
device, the bytes it reads and writes on the spill disk, and the attention FLOPs the device runs. Pure stdlib.
"""
from __future__ import annotations

import operator

from megatrain.planner.costs import kept_layers, spill_placement
from megatrain.plan.buffer_kinds import BufferKind, load_bytes
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload


def hardware_attention_flops(model: ModelShape, work: Workload) -> float:
    """The layers' causal-attention FLOPs in one step as the device runs them (inside ``hardware_flops``):
    T x L x (forward + recompute + backward) = T x L x attention_fwd(seq) x (2 + ATTENTION_BWD_FACTOR)."""
    return (work.tokens * model.num_layers
            * (2 * model.attention_flops_fwd(work.seq_len) + model.attention_flops_bwd(work.seq_len)))


def traffic(model: ModelShape, work: Workload, plan: Plan) -> tuple[float, float]:
    """(H2D, D2H) bytes one step moves, the sums of the copies ``estimate`` schedules:
    H2D = (E + L x layer + head [+ E tied]) x wc forward + L x layer x wc backward [+ (L - k) x T x h x c host ckpts]
    D2H = (L x layer + E [+ head untied]) x 4 fp32 grads [+ (L - k) x T x h x c host ckpts]
    (k kept layers: no checkpoint; ``Plan.compute_in_place``: no weights or grads copied, w = 0, else 1; wc the
    bytes a weight travels in, ``buffer_kinds.load_bytes``: c, or 4 where the device rounds the fp32 master); a
    resident block's terms are 0 (``Plan.resident_blocks``: its state is on the device)"""
    c = work.compute_bytes
    R = kept_layers.recomputed_layers(model, plan)
    ckpt = R * work.tokens * model.hidden_size * c if plan.checkpoints == "host" else 0
    tied = model.tie_word_embeddings
    w = 0 if plan.compute_in_place else 1
    numels = spill_placement.block_numels(model)  # E, L x layer, H
    loads = [2 if tied else 1] + [2] * model.num_layers + [1]  # each block's loads a step
    drains = [1] * (model.num_layers + 1) + [0 if tied else 1]  # each block's gradient drains
    # every block's elements loaded (drained), less the resident blocks': integers, the same sums in any order
    # (map: the search prices thousands of plans, without a Python step per block)
    resident = set(plan.resident_blocks)
    loaded = sum(map(operator.mul, loads, numels)) - sum(loads[b] * numels[b] for b in resident)
    drained = sum(map(operator.mul, drains, numels)) - sum(drains[b] * numels[b] for b in resident)
    h2d = w * loaded * load_bytes(c, plan.weights_cast) + ckpt
    d2h = w * drained * 4 + ckpt
    return float(h2d), float(d2h)


def disk_traffic(model: ModelShape, work: Workload, plan: Plan, tapped: bool = False) -> tuple[float, float]:
    """Bytes one step reads from and writes to the spill files: every spilled (block, kind) read once and
    written once (F_k: kind k's file, its spilled blocks x s_k rounded up to 4 KiB, s_k 2 for bf16 m and v;
    sum of F_k each way), plus, in
    fp32, the loads' reads of the blocks whose master spills (each block's h2d weight bytes x 4: the
    embedding twice when tied, each layer twice (forward and backward), the head once). ``tapped``: each
    block's first forward load takes its master from the update that writes it (a CPU device, deferred
    updates: [Note: spilled loads]), so only the backward's loads and a tied head's re-load read it."""
    spilled = spill_placement.Spilled.of(model, plan, work.state_bytes)
    read = write = float(sum(spilled.file_bytes(k) for k in spilled.kinds))
    if work.compute_bytes == 4:
        loads = [2 if model.tie_word_embeddings else 1] + [2] * model.num_layers + [1]
        if tapped:
            loads = [n - 1 for n in loads]
        read += sum(loads[b] * spilled.numels[b] * 4 for b in spilled.blocks.get(BufferKind.MASTER, ()))
    return read, write
