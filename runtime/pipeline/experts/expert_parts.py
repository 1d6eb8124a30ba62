"""The parts of a mixture-of-experts layer that stream through the device slots on their own.

[Note: expert groups]
A sparse layer is mostly experts (Qwen3-235B-A22B: 2.4B parameters a layer, 97% of them experts), so with
``Plan.expert_group_size`` g (None or 0: whole layers) it streams in parts: its dense part (attention, the
norms, the router, a shared expert) and its E experts in groups of g (the last one smaller). The block stays
the unit of host state, AdamW, checkpoints and spill placement; a part is ranges of the block's flat buffer
(the dense part: what precedes the fused expert tensors and what follows them; group j: its experts' rows of
each fused tensor, ``gate_up_proj`` and ``down_proj`` (gpt-oss: and their biases), one range each, the last
group's reaching to the next parameter so the parts tile the block) laid out contiguously in a slot. A slot, and a device gradient buffer, holds the largest
part (or embedding, head, other layer), never a whole sparse layer.

Loads of a grouped layer (step_schedule.py): forward, the dense part, then each group; backward, the dense
part (recompute of the routing, no gradient), each group, and the dense part again (its recompute and
backward). Forward: the dense part runs every micro-batch (the activation checkpoint saved as for any layer),
keeping per micro-batch h, the routed tokens, the routing and the shared term; each group then adds its
experts' outputs into one accumulator per micro-batch; after the last group, h + (experts + shared) is the
layer's output, the whole layer's operations in its order (bitwise its forward). Backward: the first dense
load recomputes the routing from the checkpoint (kept for the third load); each group recomputes its experts
with autograd and backpropagates dy, its parameter gradients in its own gradient buffer, drained to the block's
host gradient at the group's ranges, and the gradients of the routed tokens and weights summed over the groups;
the last dense load recomputes the dense part with autograd and backpropagates (dy into h and the shared term,
those sums into the tokens and the router's weights), drains, and hands the block to AdamW: the block's update
waits for its last drain (the d2h stream is in order). Gradient norms are per parameter as for a whole block,
the experts' summed over groups as squares. Float32: the forward and the experts' gradients are bitwise the
whole layer's; the gradient reaching the routed tokens is summed in another order than autograd sums it in the
whole layer, so the other gradients differ by float32 rounding noise.

Cost of streaming in parts: the dense part is loaded three times a step instead of twice and its forward
recomputed twice in backward (for Qwen3-235B-A22B 3% of a layer's bytes and about a third of its FLOPs per
token); the routed state of every micro-batch is held while the groups pass (``memory_model``'s term).
Host syncs: one read of the per-expert counts per layer pass and micro-batch (``expert_group.route``); a
whole layer reads none on the grouped path and one on the loop ([Note: grouped experts]). Not streamed in
parts: data-parallel ranks, blocks whose gradients spill, and in fp32 blocks whose master spills (their loads
read whole chunks of the master file); those are refused in one line. Sequence tiles: the dense part runs its
attention half in ``Plan.attention_tile_tokens`` tiles; the experts run over a micro-batch's routed tokens at
once, never in ``Plan.mlp_tile_tokens`` tiles (the planner counts a grouped layer's MLP untiled and never pairs
groups with MLP tiles: ``memory_model.layer_working_set``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatrain.plan.block_parameters import aligned
from megatrain.plan.buffer_kinds import BufferKind
from megatrain.plan.plan import Plan

from megatrain.models.layers.expert_group import expert_names, splits
from megatrain.runtime.errors import ConfigError
from megatrain.runtime.model.templates import Block, BlockKind, BlockLayout, ParamEntry, Templates
from megatrain.runtime.state.host_store import HostStore


@dataclass(frozen=True)
class Part:
    """A part of a layer block, resident in a slot of its own."""

    number: int  # 0 the dense part; 1 + j expert group j
    layout: BlockLayout  # the part's parameters as views of its slot (and of its gradient buffer)
    ranges: tuple[tuple[int, int, int], ...]  # (first element in the block, elements, first element in the slot)
    entries: tuple[int, ...]  # per layout entry, its index among the block's entries
    experts: range  # the group's experts; empty for the dense part
    last: bool = False  # the layer's last expert group

    @property
    def numel(self) -> int:
        return self.layout.numel


def layer_parts(templates: Templates, group_size: int | None) -> dict[int, tuple[Part, ...]]:
    """Per sparse layer block (by block index), its parts: the dense part, then the expert groups of
    ``group_size`` experts; empty when the plan streams whole layers (None, 0) or the model has no experts."""
    if not group_size or not templates.config.num_experts:
        return {}
    layer = templates.modules[BlockKind.LAYER]
    if not splits(layer):
        raise ConfigError(f"expert_group_size={group_size}: model_type={templates.config.model_type!r} has no "
                          "expert layer megatrain streams in groups; plan with expert_group_size null")
    names = expert_names(layer)
    return {b.index: _parts(b, templates.config.num_experts, group_size, names) for b in templates.layers}


def _parts(block: Block, num_experts: int, g: int, fused: tuple[str, ...]) -> tuple[Part, ...]:
    entries = block.layout.entries
    names = [e.local_name for e in entries]
    first = names.index(fused[0])
    at = list(range(first, first + len(fused)))
    assert [names[i] for i in at] == list(fused), "the fused expert tensors are adjacent in the layout"
    ends = [entries[i + 1].offset if i + 1 < len(entries) else block.layout.numel for i in at]  # with padding
    lo_x, cut = entries[first].offset, ends[-1] - entries[first].offset  # the experts' elements
    dense_entries = [e if i < first else dataclasses.replace(e, offset=e.offset - cut)
                     for i, e in enumerate(entries) if i not in at]
    dense = Part(0, BlockLayout(tuple(dense_entries), block.layout.numel - cut),
                 ((0, lo_x, 0), (ends[-1], block.layout.numel - ends[-1], lo_x)),
                 tuple(i for i in range(len(entries)) if i not in at), range(0))
    parts = [dense]
    for j, lo in enumerate(range(0, num_experts, g)):
        n = min(g, num_experts - lo)
        last = lo + n == num_experts
        layout, ranges, slot = [], [], 0
        for i, end in zip(at, ends):
            e = entries[i]
            per = e.numel // num_experts
            start = e.offset + lo * per
            count = end - start if last else n * per  # the last group takes the padding after its tensor
            layout.append(dataclasses.replace(e, shape=(n, *e.shape[1:]), offset=slot))
            ranges.append((start, count, slot))
            slot += aligned(count)
        parts.append(Part(1 + j, BlockLayout(tuple(layout), slot), tuple(ranges), tuple(at), range(lo, lo + n), last))
    covered = sorted((lo, n) for p in parts for lo, n, _ in p.ranges)
    assert all(a + n == b for (a, n), (b, _) in zip(covered, covered[1:])) and covered[-1][0] + covered[-1][1] == \
        block.layout.numel, "the parts tile the block"
    return tuple(parts)


def streamed_parts(templates: Templates, plan: Plan, store: HostStore, data_parallel: bool,
                   whole: int) -> tuple[dict[int, tuple[Part, ...]], int]:
    """The executor's parts (``layer_parts`` of the plan's group size, checked by ``check_streamable``) and its slot
    size: ``whole`` (the largest block) when every layer streams whole, else ``slot_numel``."""
    parts = layer_parts(templates, plan.expert_group_size)
    check_streamable(parts, store, data_parallel)
    if parts and plan.kept_layers:
        raise ConfigError("kept_layers: a layer streamed in expert groups is recomputed; plan with kept_layers [] "
                          "or expert_group_size null")
    return parts, slot_numel(templates, parts) if parts else whole


def slot_numel(templates: Templates, parts: dict[int, tuple[Part, ...]]) -> int:
    """Elements of one slot: the largest block streamed whole or part (``Plan.num_slots`` x this x compute bytes
    on the device, and ``device_grad_buffers`` x this x 4)."""
    return max(max(p.numel for p in parts[b.index]) if b.index in parts else b.layout.numel for b in templates.blocks)


def check_streamable(parts: dict[int, tuple[Part, ...]], store: HostStore, data_parallel: bool) -> None:
    """Refuse (one line) what streaming in parts does not do: data parallelism, spilled gradients, and loads
    read from a spilled fp32 master (see [Note: expert groups])."""
    if not parts:
        return
    if data_parallel:
        raise ConfigError("expert groups (expert_group_size) are not streamed across data-parallel ranks; plan "
                          "with expert_group_size null")
    for b in parts:
        if store.is_spilled(BufferKind.GRADS, b) or store.load_source(b) is None:
            raise ConfigError(f"expert groups (expert_group_size) need block {b}'s gradients in RAM and its weights "
                              "in RAM or a compute-dtype shadow; plan with fewer spilled gradients (or bf16), or "
                              "expert_group_size null")
