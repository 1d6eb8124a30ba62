"""The AdamW worker's spill I/O across the step boundary, read from its event log: the next step's first chunks
are read ahead while this step's last ones update (eager: and on through the step, ahead of each job), never
before their own writes, never more than the plan's staging sets at once; and training stays bitwise what it is
without spill."""
from __future__ import annotations

import time

import pytest
import torch

from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan

CONFIG = ModelConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=4,
                     num_attention_heads=2, num_key_value_heads=1)


def _batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, CONFIG.vocab_size, (4, 8), generator=gen) for _ in range(steps)]


def _spill_log(plan: Plan, steps: int = 3, pause: float = 0.0):
    """The event log of ``steps`` steps; ``pause`` seconds between them (the read-ahead's time to read into the
    disk's idle moments, which a step of this tiny model leaves few of on a busy machine)."""
    clip = 1.0 if plan.optimizer_mode == "deferred" else None
    with Engine(CONFIG, OptimizerConfig(lr=1e-3, max_grad_norm=clip), plan=plan, compute_dtype=torch.float32,
                device="cpu", seed=0) as engine:
        engine.event_log.enabled = True
        for ids in _batches(steps):
            engine.step(ids, ids)
            time.sleep(pause)
        engine.synchronize()
        files = engine.store.disk
        pieces = [(b, lo) for b in range(len(engine.store.numels)) if files.spilled(b) for lo, _ in files.chunks(b)]
        return list(engine.event_log.entries), pieces


SPILL_DIR = "@spill@"  # replaced by a temporary directory
PLANS = [Plan(spill="all", spill_dir=SPILL_DIR, spill_staging=3, spill_chunk_bytes=4096),
         Plan(spill="optimizer", spill_dir=SPILL_DIR, spill_staging=2, spill_chunk_bytes=4096, optimizer_mode="eager"),
         Plan(spill="blocks", spill_dir=SPILL_DIR, spill_staging=3, spill_chunk_bytes=4096,
              spill_blocks={"master": [2, 3], "exp_avg": [1, 2, 3, 5], "exp_avg_sq": [1, 2, 3, 5], "grads": [0, 4]}),
         # Only the head spills, one piece: last of a step and first of the next, its read waits for its update.
         Plan(spill="blocks", spill_dir=SPILL_DIR, spill_staging=3,
              spill_blocks={"master": [5], "exp_avg": [5], "exp_avg_sq": [5]})]


@pytest.mark.parametrize("plan", PLANS, ids=["all-deferred", "optimizer-eager", "blocks-deferred", "head-only"])
def test_reads_run_ahead_across_the_step_boundary_in_order_and_bounded(plan: Plan, tmp_path) -> None:
    steps = 3
    log, pieces = _spill_log(plan.replace(spill_dir=str(tmp_path)), steps, pause=0.3)
    at = {}
    for i, e in enumerate(log):
        if not e.op.startswith(("spill_", "adam_")):
            continue
        key = (e.op, e.step, e.block, e.lo)
        assert key not in at, f"{key} logged twice"
        at[key] = i
    # Every spilled piece is read once and written once per step; nothing read ahead is dropped in steady training.
    for step in range(1, steps + 1):
        for b, lo in pieces:
            assert at[("spill_read", step, b, lo)] < at[("spill_write", step, b, lo)]
    assert not [e for e in log if e.op == "spill_discard"]
    order = {}  # per step, the blocks in the order AdamW began them
    for e in log:
        if e.op == "adam_begin":
            order.setdefault(e.step, []).append(e.block)
    for step in range(2, steps + 1):
        first = [(b, lo) for b in order[step] for (pb, lo) in pieces if pb == b]
        # The next step's first pieces are read ahead: issued before the job of their own block was submitted
        # (as soon as a staging set is back from this step's writes; the worker never waits for one while it has
        # updates to run, so the read may come after this step's last update).
        b, lo = first[0]
        read = at[("spill_read", step, b, lo)]
        assert log[read].phase == "ahead"
        assert read < at[("adam_submit", step, b, -1)]
        ahead = [(e.block, e.lo) for e in log if e.op == "spill_read" and e.step == step and e.phase == "ahead"]
        assert ahead[0] == first[0] and [first.index(p) for p in ahead] == sorted(first.index(p) for p in ahead)
        if plan.optimizer_mode == "deferred":  # the step's jobs come at once: only the sets' worth is read ahead
            assert ahead == first[:len(ahead)] and len(ahead) <= plan.spill_staging
        for b, lo in ahead:  # eager: as sets free up, the pieces of the jobs still to come, before they are taken
            assert at[("spill_read", step, b, lo)] < at[("adam_begin", step, b, -1)]
        # A piece is read only after its previous update's writes were issued (the read then waits for them).
        for b, lo in pieces:
            assert at[("spill_write", step - 1, b, lo)] < at[("spill_read", step, b, lo)]
    # Bound: a staging set is held from a piece's read to its write; never more than the plan's sets at once.
    held = 0
    for e in log:
        held += {"spill_read": 1, "spill_write": -1, "spill_discard": -1}.get(e.op, 0)
        assert 0 <= held <= plan.spill_staging


def test_a_state_written_between_steps_drops_what_was_read_ahead(tmp_path) -> None:
    """Weights loaded between two steps replace the fp32 master read ahead: those reads are dropped and read
    again, and training goes on bitwise as without spill."""
    opt = OptimizerConfig(lr=1e-3, max_grad_norm=1.0)
    plans = (Plan(), Plan(spill="all", spill_dir=str(tmp_path), spill_staging=3, spill_chunk_bytes=4096))
    batches = _batches(4)
    results = []
    for plan in plans:
        with Engine(CONFIG, opt, plan=plan, compute_dtype=torch.float32, device="cpu", seed=0) as engine:
            engine.event_log.enabled = True
            for ids in batches[:2]:
                engine.step(ids, ids)
            engine.synchronize()
            state = engine.state_dict()
            engine.load_state_dict({k: v * 0.5 for k, v in state.items()})
            for ids in batches[2:]:
                engine.step(ids, ids)
            results.append((engine.state_dict(), engine.optimizer_state_dict(),
                            [e for e in engine.event_log.entries if e.op == "spill_discard"]))
    (pa, oa, _), (pb, ob, dropped) = results
    assert dropped and {e.step for e in dropped} == {3}
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    for k in oa:
        assert all(torch.equal(oa[k][f], ob[k][f]) for f in ("exp_avg", "exp_avg_sq", "step")), k


def test_a_deep_read_ahead_fills_every_staging_set_before_the_backward_ends_and_trains_bitwise(tmp_path) -> None:
    """The planner's deeper staging (spill_choices.SPILL_STAGING): every set is filled with the next step's first
    pieces, in update order, after this step's updates and, given the disk's idle time between the steps, before
    the next step's backward hands over its first job; never more than the sets; and training stays bitwise what
    it is without spill."""
    staging = 6
    plan = Plan(spill="all", spill_dir=str(tmp_path), spill_staging=staging, spill_chunk_bytes=4096)
    steps = 3
    log, pieces = _spill_log(plan, steps, pause=0.5)
    assert len(pieces) > staging
    at = {(e.op, e.step, e.block, e.lo): i for i, e in enumerate(log) if e.op.startswith(("spill_", "adam_"))}
    for step in range(2, steps + 1):
        ahead = [i for i, e in enumerate(log) if e.op == "spill_read" and e.step == step and e.phase == "ahead"]
        assert [(log[i].block, log[i].lo) for i in ahead] == pieces[:staging]  # forward order is the update order
        submitted = min(i for i, e in enumerate(log) if e.op == "adam_submit" and e.step == step)
        assert max(ahead) < submitted
        # each read ahead after its own chunk's writes of the step before
        assert all(at[("spill_write", step - 1, log[i].block, log[i].lo)] < i for i in ahead)
        # the backward of that step ran while they were in flight: its first backward compute comes after the first
        first_bwd = min(i for i, e in enumerate(log) if e.op == "compute" and e.step == step and e.phase == "bwd")
        assert min(ahead) < first_bwd
    held = 0
    for e in log:
        held += {"spill_read": 1, "spill_write": -1, "spill_discard": -1}.get(e.op, 0)
        assert 0 <= held <= staging
    opt = OptimizerConfig(lr=1e-3, max_grad_norm=1.0)
    states = []
    for p in (Plan(), plan.replace(spill_dir=str(tmp_path / "again"))):
        (tmp_path / "again").mkdir(exist_ok=True)
        with Engine(CONFIG, opt, plan=p, compute_dtype=torch.float32, device="cpu", seed=0) as engine:
            for ids in _batches(steps):
                engine.step(ids, ids)
            states.append((engine.state_dict(), engine.optimizer_state_dict()))
    (pa, oa), (pb, ob) = states
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    for k in oa:
        assert all(torch.equal(oa[k][f], ob[k][f]) for f in ("exp_avg", "exp_avg_sq", "step")), k
