"""The executor's schedule, read from its event log, against the pipeline's invariants."""
from __future__ import annotations

import pytest
import torch

from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan

CONFIG = ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                     num_attention_heads=2, num_key_value_heads=1)


def _run(plan: Plan, tied: bool = False, steps: int = 3, clip: float | None = 1.0):
    config = ModelConfig(**{**CONFIG.to_dict(), "tie_word_embeddings": tied})
    engine = Engine(config, OptimizerConfig(lr=1e-3, max_grad_norm=clip), plan=plan,
                    compute_dtype=torch.float32, device="cpu")
    engine.event_log.enabled = True
    ids = torch.randint(0, config.vocab_size, (4, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        engine.step(ids, ids)
    engine.synchronize()
    log = list(engine.event_log.entries)
    engine.close()
    return engine, log


PLANS = [
    Plan(num_slots=2, prefetch_depth=1, micro_batch_size=2),
    Plan(num_slots=3, prefetch_depth=2, micro_batch_size=1, checkpoints="host"),
    Plan(num_slots=4, prefetch_depth=1, micro_batch_size=4, checkpoints="host"),
    Plan(num_slots=4, prefetch_depth=3, micro_batch_size=3, optimizer_mode="eager", host_grad_slabs=1),
]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"K{p.num_slots}d{p.prefetch_depth}-{p.checkpoints}-{p.optimizer_mode}")
def test_schedule_invariants(plan: Plan, tied: bool) -> None:
    clip = None if plan.optimizer_mode == "eager" else 1.0
    engine, log = _run(plan, tied, clip=clip)
    k = plan.num_slots
    position = {id(e): i for i, e in enumerate(log)}

    def index_of(op, **match):
        hits = [i for i, e in enumerate(log) if e.op == op and all(getattr(e, f) == v for f, v in match.items())]
        assert len(hits) == 1, f"expected one {op} {match}, found {len(hits)}"
        return hits[0]

    resident = set()
    for i, e in enumerate(log):
        if e.op == "compute":
            # No compute on a slot before its H2D: the load was issued into this very slot, earlier.
            h = index_of("h2d", step=e.step, load=e.load)
            assert h < i and log[h].slot == e.slot and log[h].block == e.block
        elif e.op == "h2d":
            # No H2D into a slot before its last use ended.
            if e.load >= k:
                r = index_of("release", step=e.step, load=e.load - k)
                assert r < i and log[r].slot == e.slot
            # The next step's H2D of block b comes after AdamW finished b's previous update.
            if e.step > 1:
                assert index_of("adam_end", step=e.step - 1, block=e.block) < i
            resident.add((e.step, e.load))
            assert len(resident) <= k, f"{len(resident)} blocks resident with {k} slots"
        elif e.op == "release":
            resident.remove((e.step, e.load))

    # Prefetch really runs ahead: a forward layer's successor is loading before the layer computes.
    for e in log:
        if e.op == "compute" and e.phase == "fwd" and engine.templates.blocks[e.block].kind.value == "layer":
            nxt = [x for x in log if x.op == "h2d" and x.step == e.step and x.load == e.load + 1]
            assert nxt and position[id(nxt[0])] < position[id(e)], "no prefetch ahead of a forward layer"

    n_blocks = len(engine.templates.blocks)
    for step in (1, 2, 3):
        submits = [e.block for e in log if e.op == "adam_submit" and e.step == step]
        assert sorted(submits) == list(range(n_blocks)), "every block updated exactly once per step"
        last_bwd = max(i for i, e in enumerate(log) if e.op == "compute" and e.step == step and e.phase == "bwd")
        first_submit = index_of("adam_submit", step=step, block=submits[0])
        if plan.optimizer_mode == "eager":
            # Eager: the head's update is queued before backward even starts its layers.
            assert submits[0] == n_blocks - 1 and first_submit < last_bwd
        else:
            # Deferred: all after backward (they need the global norm), in forward order.
            assert submits == list(range(n_blocks)) and first_submit > last_bwd


def test_weights_load_once_per_pass() -> None:
    """Forward loads every block once (the embedding twice when tied); backward every layer once."""
    for tied in (False, True):
        engine, log = _run(PLANS[0], tied, steps=1)
        loads = [(e.block, e.phase) for e in log if e.op == "h2d"]
        n = len(engine.templates.blocks)
        fwd = [(b, "fwd") for b in range(n)] + ([(0, "fwd")] if tied else [])
        bwd = [(b, "bwd") for b in range(n - 2, 0, -1)]
        assert loads == fwd + bwd


@pytest.mark.parametrize("checkpoints", ["device", "host"])
def test_kept_layers_are_not_recomputed(checkpoints: str) -> None:
    """A kept layer's forward keeps its graph (every micro-batch) and its backward runs through it: no recompute,
    no checkpoint drained or reloaded; every other layer is recomputed once per micro-batch. Backward still loads
    every layer once (the kept graph reads its weights from that load)."""
    kept = (0, 2)
    plan = Plan(num_slots=2, micro_batch_size=2, checkpoints=checkpoints, kept_layers=kept)
    engine, log = _run(plan, steps=2)
    layers = [b.index for b in engine.templates.layers]
    kept_blocks = {layers[k] for k in kept}
    for step in (1, 2):
        entries = [e for e in log if e.step == step]
        for op in ("kept_forward", "kept_backward"):
            assert sorted((e.block, e.micro) for e in entries if e.op == op) == sorted(
                (b, m) for b in kept_blocks for m in range(2)), op
        recomputed = [e.block for e in entries if e.op == "recompute"]
        assert sorted(recomputed) == sorted(b for b in layers if b not in kept_blocks for _ in range(2))
        assert not kept_blocks & {e.block for e in entries if e.op.startswith("ckpt_")}
        if checkpoints == "host":
            assert {e.block for e in entries if e.op == "ckpt_drain"} == set(layers) - kept_blocks
        # A kept layer's backward comes while its block is resident for backward.
        for e in entries:
            if e.op == "kept_backward":
                computing = [x for x in entries[:entries.index(e)] if x.op == "compute"][-1]
                assert computing.block == e.block and computing.phase == "bwd"
        loads = [(e.block, e.phase) for e in entries if e.op == "h2d"]
        assert loads.count((layers[0], "bwd")) == 1 and len([x for x in loads if x[1] == "bwd"]) == len(layers)
