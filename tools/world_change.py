"""A run resumed at another world size: the plan is made again for the new per-rank batch.

A data-parallel checkpoint is the single-process format (runtime/io/sharded_checkpoint.py), so any world size
loads it; what does not carry over is the plan, which the planner made for one rank's share of the global batch
(``Plan.workload.batch``). The global batch, the data order and position and the lr schedule are the run's and do
not depend on the world size: every rank reads the same global batches and takes its rows (tools/ranks.py).

The world size a checkpoint was written at is kept with it (``WORLD_SIZE_KEY`` in the checkpoint's extra); a
checkpoint written before that was kept is judged by its plan's batch against this rank's share.
"""
from __future__ import annotations

from typing import Any, Mapping

from megatrain.plan.plan import Plan

WORLD_SIZE_KEY = "world_size"


def saved_world_size(extra: Mapping[str, Any], plan: Plan, batch: int) -> int | None:
    """The world size the checkpoint was written at; None when neither the extra nor the plan says."""
    if WORLD_SIZE_KEY in extra:
        return int(extra[WORLD_SIZE_KEY])
    planned = plan.workload.batch if plan.workload is not None else None
    if planned is None or batch % planned:
        return None
    return batch // planned


def replan(extra: Mapping[str, Any], plan: Plan, batch: int, world_size: int) -> str | None:
    """The line a resume at another world size says (it re-plans), or None when the resumed plan is this world
    size's (or the checkpoint does not say which it was)."""
    saved = saved_world_size(extra, plan, batch)
    if saved is None or saved == world_size:
        return None
    return (f"world size {saved} -> {world_size}: planned again for {batch // world_size} sequences per rank "
            f"(the global batch of {batch}, the data order and position and the lr schedule are unchanged)")
