"""Optimizer state on the device: which blocks a plan keeps there (``Plan.resident_blocks``), what that costs in
device memory and saves in host RAM and PCIe traffic, and the choices the search times. Pure stdlib.

A resident block's fp32 master, AdamW m and v and gradient live in device memory, 16 bytes a parameter
(the runtime's [Note: resident blocks]); none of its state is in host RAM, its loads cross no link (its master is
cast on the device), its gradient drains nowhere, and torch's fused AdamW updates it on the device, reading and
writing 28 bytes a parameter (master, gradient, m, v read; master, m, v written; with clipping 8 more, the
gradient multiplied by the clip coefficient first) where the CPU AdamW would take 1 / (AdamW params/s). A data-parallel rank holds and updates its shard of each (align64(ceil(n / W)) elements of a
block of n). The search tries them in forward order (the embedding, the layers, the head): deferred
updates run in forward order, so the blocks the next forward needs first are the ones whose updates leave the CPU;
eager ones in backward order, so the updates left after backward are the same blocks.
"""
from __future__ import annotations

from typing import Callable, Sequence

from megatrain.plan.block_parameters import aligned
from megatrain.planner.profiling.hardware import DEVICE_ADAM_BYTES_PER_PARAM, HardwareProfile
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload
from megatrain.planner.costs import budget_boundary
from megatrain.planner.costs.spill_placement import block_numels

# Device bytes a resident parameter holds: fp32 master, m, v, gradient.
RESIDENT_BYTES_PER_PARAM = 16
# DEVICE_ADAM_BYTES_PER_PARAM (hardware.py, where the profile measures the rate): the device memory traffic of one
# fused AdamW update of a parameter, master, gradient, m, v read (16), master, m, v written (12): 28.
# The device memory bandwidth the fused AdamW reaches, GB/s, where the profile has not measured it
# (``HardwareProfile.device_adam_gbps`` 0: a preset, a profile from before it was measured): an H100's HBM3 is
# 3350 GB/s on its datasheet, an H200's HBM3e 4800; an elementwise kernel reaches most of it.
DEVICE_ADAM_GBPS = 2500.0
# With clipping the device AdamW first multiplies the block's gradient by the clip coefficient (the runtime's
# device_adamw.py): the gradient read and written once more, 8 bytes a parameter at the same rate.
DEVICE_CLIP_BYTES_PER_PARAM = 8


def resident_numel(model: ModelShape, plan: Plan) -> int:
    """Nr: the elements of the plan's resident blocks."""
    if not plan.resident_blocks:  # most plans: no list of every block's elements built (a memory estimate asks thrice)
        return 0
    numels = block_numels(model)
    return sum(numels[b] for b in plan.resident_blocks)


def largest_host_block(model: ModelShape, plan: Plan) -> int:
    """Bh: the largest block not resident (0 when every block is): what an eager host slab holds."""
    if not plan.resident_blocks:
        return model.numel_largest_block  # max(E, layer, head), every block's size
    resident = set(plan.resident_blocks)
    return max((n for b, n in enumerate(block_numels(model)) if b not in resident), default=0)


def device_adam_gbps(hw: HardwareProfile) -> float:
    """The GB/s the device's fused AdamW reaches: the profile's measured figure, else ``DEVICE_ADAM_GBPS``."""
    return hw.device_adam_gbps if hw.device_adam_gbps > 0 else DEVICE_ADAM_GBPS


def device_adam_seconds(numel: int, gbps: float, clipping: bool = False) -> float:
    """One resident update on a GPU: numel x (28 B, + 8 B with ``clipping``) / the device AdamW's GB/s
    (``device_adam_gbps``)."""
    return numel * (DEVICE_ADAM_BYTES_PER_PARAM + (DEVICE_CLIP_BYTES_PER_PARAM if clipping else 0)) / (gbps * 1e9)


def first_blocks(model: ModelShape, r: int) -> tuple[int, ...]:
    """The first r blocks in forward order: 0 the embedding, 1..L the layers, L + 1 the head."""
    return tuple(range(min(r, model.num_layers + 2)))


def may_hold(plan: Plan, work: Workload) -> bool:
    """Whether a candidate may keep blocks on the device: nothing spilled, whole layers, weights not computed on in
    place (the plan's own checks), fp32 AdamW state (the runtime's device AdamW keeps no bf16 state); the search also
    asks for a GPU (one process or data-parallel ranks: the runtime shards a resident block as any other)."""
    return (plan.spill == "none" and not plan.expert_group_size and not plan.compute_in_place
            and work.optimizer_state == "fp32")


def most_resident(model: ModelShape, plan: Plan, excess: Callable[[Plan], Sequence[int]]) -> Plan:
    """``plan`` with the most first blocks resident that still fit (``excess``: a plan's bytes needed beyond each
    budget, at most 0 where it fits; each block more adds device memory, a layer's as much as the next:
    ``budget_boundary.last_fitting``), at least its own (its first blocks: what host RAM may need), ``plan`` itself
    when not even one more fits."""
    def with_count(r: int) -> Plan:
        return plan.replace(resident_blocks=first_blocks(model, r))

    # the plan as given fits: the answer lies in [its own, every block]
    r = budget_boundary.last_fitting(range(len(plan.resident_blocks), model.num_layers + 3),
                                     lambda r: excess(with_count(r)))
    return with_count(len(plan.resident_blocks) if r is None else r)


def crossing(plan: Plan, w: int, wc: int) -> tuple[Callable[[int], int], Callable[[int], int]]:
    """Per block b, (w_b, wc_b): whether its gradient drains (``w``: 1, 0 computing in place) and the bytes a weight
    of it loads in (``wc``), both 0 for a resident block: it crosses no link."""
    resident = frozenset(plan.resident_blocks)
    return (lambda b: 0 if b in resident else w), (lambda b: 0 if b in resident else wc)


def add_device_updates(model: ModelShape, plan: Plan, steps: list, n_fwd: int, hw: HardwareProfile,
                       world: int = 1, clipping: bool = False) -> None:
    """The resident blocks' updates added to the compute of the step's visits (``step_replay.BlockVisit``): eager,
    each to its block's last visit (the head's in forward, a layer's backward, the embedding's at the end);
    deferred, all of them after backward (the last visit), in forward order on the device before the next forward.
    Each takes ``device_adam_seconds`` at ``hw``'s device AdamW rate on a GPU (the clip's multiply too, with
    ``clipping``), numel / (all cores' AdamW params/s) where the device is the CPU; one of ``world`` data-parallel
    ranks updates its shard of the block, align64(ceil(numel / world)) elements."""
    numels = [n if world == 1 else aligned(-(-n // world)) for n in block_numels(model)]
    L, gbps = model.num_layers, device_adam_gbps(hw)

    def seconds(b: int) -> float:
        if hw.device_is_host:
            return numels[b] / hw.cpu_adam_params_per_s
        return device_adam_seconds(numels[b], gbps, clipping)

    for b in plan.resident_blocks:
        if plan.optimizer_mode != "eager":
            at = len(steps) - 1
        elif b == L + 1 and not model.tie_word_embeddings:
            at = n_fwd - 1  # the head's visit in forward computes its gradient whole
        else:  # a layer's backward visit (layers in reverse after the forward), or the embedding's (last, with a
            at = len(steps) - 1 if b in (0, L + 1) else n_fwd + (L - b)  # tied head's norm)
        steps[at].compute_s += seconds(b)
