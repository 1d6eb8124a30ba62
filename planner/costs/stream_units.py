"""What a step streams through the device, unit by unit: the elements of one weight slot and of one device
gradient accumulator (the memory model's Bu and Bg; the runtime sizes its slots and gradient buffers the same
way: expert_parts.slot_numel, the executor's gradient unit). Pure stdlib."""
from __future__ import annotations

from megatrain.plan.block_parameters import LAYER
from megatrain.planner.shapes.model_shapes import ModelShape
from megatrain.plan.plan import Plan


def grouped(model: ModelShape, plan: Plan) -> bool:
    """Whether ``plan`` streams ``model``'s sparse layers in expert groups (the runtime's [Note: expert groups])."""
    return bool(plan.expert_group_size) and model.experts.num_experts > 0


def slot_numel(model: ModelShape, plan: Plan) -> tuple[int, str]:
    """Elements of one weight slot, and the symbol: the largest unit a step streams. Whole layers: Bmax. Expert
    groups of g = ``plan.expert_group_size`` (a sparse model):
      Bu = max(E, Hd, D, Xg), D = layer - X
    with E the embedding's and Hd the head's elements, X the layer's fused experts and Xg the largest group
    (``ExpertShape.experts_numel``, ``group_numel``: a(g x 2I x h) + a(g x h x I), a(n) n rounded up to 64
    elements; gpt-oss adds its biases' rows, a(g x 2I) + a(g x h)), D the dense part (attention, norms, router,
    shared expert). The device budget bounds g."""
    if not grouped(model, plan):
        return model.numel_largest_block, "Bmax"
    return max(model.numel_embedding, model.numel_head, *_layer_units(model, plan)), "Bu"


def grad_numel(model: ModelShape, plan: Plan) -> tuple[int, str]:
    """Elements of one device gradient accumulator, and the symbol: a slot's (Bu), but with a tied embedding the
    embedding's gradient adds up in a buffer of its own (the memory model's "tied embedding grad") and the head
    holds only its norm, so no accumulator takes the embedding:
      Bg = max(Hd, layer)           (expert groups: max(Hd, D, Xg))
    For a tied Llama-3.2-3B shape 100.7M elements against Bmax = E = 394.0M. The resident blocks' gradients add up
    in their own device buffers ([Note: resident blocks]): Bg is the largest of the others (0 when none is left)."""
    if plan.resident_blocks and not grouped(model, plan):
        skip = set(plan.resident_blocks) | ({0} if model.tie_word_embeddings else set())
        numels = [model.numel_embedding] + [model.numel_layer] * model.num_layers + [model.numel_head]
        return max((n for b, n in enumerate(numels) if b not in skip), default=0), "Bg"
    if not model.tie_word_embeddings:
        return slot_numel(model, plan)
    layer = _layer_units(model, plan) if grouped(model, plan) else (model.numel_layer,)
    return max(model.numel_head, *layer), "Bg"


def _layer_units(model: ModelShape, plan: Plan) -> tuple[int, int]:
    """A layer streamed in expert groups: its dense part D and its largest group Xg (``slot_numel``)."""
    h, e = model.hidden_size, model.experts.num_experts
    rows = tuple(p.numel // e for p in model.table(LAYER) if p.name.startswith("mlp.experts."))  # per expert
    dense = model.numel_layer - model.experts.experts_numel(h, rows)
    assert plan.expert_group_size is not None
    return dense, model.experts.group_numel(h, plan.expert_group_size, rows)
