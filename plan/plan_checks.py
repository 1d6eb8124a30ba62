"""A plan's errors and the checks its fields share: one line each, naming the field, the value and the fix.
Pure stdlib."""
from __future__ import annotations

from typing import Any

from megatrain.errors import MegatrainError


class PlanError(MegatrainError):
    """A Plan field is out of range, or a plan file cannot be read.

    The message is one line: the field, the value, and how to fix it.
    """


def at_least(field: str, value: Any, low: int, why: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise PlanError(f"{field}={value!r} must be an integer >= {low} ({why})")


def one_of(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise PlanError(f"{field}={value!r} must be one of {', '.join(repr(c) for c in choices)}")


def kept_layer_numbers(value: Any) -> tuple[int, ...]:
    """``Plan.kept_layers`` checked: distinct decoder layer numbers >= 0, sorted."""
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in value):
        raise PlanError(f"kept_layers={value!r} must be a list of decoder layer numbers >= 0 (0 the first layer)")
    if len(set(value)) != len(value):
        raise PlanError(f"kept_layers={list(value)!r} names a layer twice; list each layer once")
    return tuple(sorted(value))


def master_spills(plan: Any) -> bool:
    """Whether a ``Plan`` puts any block's fp32 master in a spill file."""
    blocks = plan.spill_blocks
    return plan.spill == "all" or (plan.spill == "blocks" and blocks is not None and bool(blocks.master))


def check_host_device(plan: Any) -> None:
    """A ``Plan``'s ``compute_in_place``, ``weights_cast`` and ``adam_thread`` against what they need: every block's
    weights and gradients whole in RAM (deferred mode, no expert groups, no master or gradient spilled), every
    master in RAM for a cast on the device, and nothing spilled for AdamW on the compute thread (it would wait for
    the disk)."""
    if not isinstance(plan.compute_in_place, bool):
        raise PlanError(f"compute_in_place={plan.compute_in_place!r} must be true or false")
    blocks = plan.spill_blocks
    spilled = master_spills(plan) or (plan.spill == "blocks" and blocks is not None and bool(blocks.grads))
    why = ("eager updates take gradients from slabs" if plan.optimizer_mode != "deferred" else
           "a layer streamed in expert groups is copied part by part" if plan.expert_group_size else
           "the master or the gradients spill" if spilled else None)
    if plan.compute_in_place and why:
        raise PlanError(f"compute_in_place needs every block's weights and gradients whole in RAM, but {why}; "
                        "set compute_in_place to false")
    if plan.weights_cast == "device" and master_spills(plan):
        raise PlanError("weights_cast='device' copies each block's fp32 master from RAM, but the master spills; "
                        "set weights_cast to 'host' or keep the master in RAM")
    if plan.adam_thread == "compute" and plan.spill != "none":
        raise PlanError(f"adam_thread='compute' cannot wait for spill I/O (spill={plan.spill!r}): "
                        "use adam_thread='worker' with a spill plan")


def resident_block_numbers(value: Any) -> tuple[int, ...]:
    """``Plan.resident_blocks`` checked: distinct block indices >= 0, sorted."""
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in value):
        raise PlanError(f"resident_blocks={value!r} must be a list of block indices >= 0 "
                        "(0 the embedding, 1..L the layers, L + 1 the head)")
    if len(set(value)) != len(value):
        raise PlanError(f"resident_blocks={list(value)!r} names a block twice; list each block once")
    return tuple(sorted(value))


def check_resident(plan: Any) -> None:
    """A ``Plan``'s ``resident_blocks`` (fp32 master, m, v and gradient in device memory, updated there) against
    what they exclude: a spill file for any of their state, computing in place on the host's weights, and layers
    streamed in expert groups (whose gradients drain part by part to the host)."""
    if not plan.resident_blocks:
        return
    named = plan.spill_blocks
    on_disk = set() if named is None else {b for kind in ("master", "exp_avg", "exp_avg_sq", "grads")
                                           for b in named.blocks(kind)}
    why = (f"spill={plan.spill!r} puts every block's state on disk" if plan.spill in ("optimizer", "all") else
           f"spill_blocks names block {min(on_disk & set(plan.resident_blocks))}"
           if on_disk & set(plan.resident_blocks) else
           "compute_in_place computes on the host's weights" if plan.compute_in_place else
           "layers stream in expert groups" if plan.expert_group_size else None)
    if why:
        raise PlanError(f"resident_blocks keeps those blocks' state on the device, but {why}; "
                        "drop resident_blocks or plan again with megatrain-plan plan")


def check_resident_blocks(plan: Any, num_blocks: int) -> None:
    """Refuse a ``Plan``'s resident block that a model of ``num_blocks`` blocks does not have (one line)."""
    bad = [b for b in plan.resident_blocks if b >= num_blocks]
    if bad:
        raise PlanError(f"resident_blocks names block {bad[0]}, but this model has {num_blocks} blocks "
                        f"(0 .. {num_blocks - 1}); plan again for this model with megatrain-plan plan")


def check_compiled(plan: Any) -> None:
    """A ``Plan``'s ``compiled_layers`` (the decoder layers' forward through torch.compile) against what it compiles:
    whole layers, so no sequence tiles (their tiled backward calls the layer in parts) and no expert groups (a
    sparse layer's routing reads host counts and changes its shapes every step)."""
    if not isinstance(plan.compiled_layers, bool):
        raise PlanError(f"compiled_layers={plan.compiled_layers!r} must be true or false")
    why = ("mlp_tile_tokens tiles the MLP" if plan.mlp_tile_tokens else
           "attention_tile_tokens tiles the attention's projections" if plan.attention_tile_tokens else
           "layers stream in expert groups" if plan.expert_group_size else None)
    if plan.compiled_layers and why:
        raise PlanError(f"compiled_layers compiles whole layers, but {why}; set compiled_layers to false")
