"""A CPU device computing in place and running AdamW on the compute thread ([Note: compute in place] in
weight_slots.py, ``Plan.adam_thread``): the same bits as the copies and the worker thread, no buffer of its own,
nothing copied, every update done when ``step`` returns; and the plans that cannot do it refused in one line."""
from __future__ import annotations

import threading

import pytest
import torch

from megatrain.plan.plan import Plan, PlanError
from megatrain.runtime import Engine, ModelConfig, OptimizerConfig

CONFIG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=True, qk_norm=True)
BASE = Plan(micro_batch_size=2, kept_layers=(1,), checkpoints="host", num_slots=3, prefetch_depth=2)


def _train(plan: Plan, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor], dict[str, float]]:
    """Losses, weights and the last step's breakdown of ``steps`` steps."""
    gen = torch.Generator().manual_seed(7)
    with Engine(CONFIG, OptimizerConfig(lr=1e-3, max_grad_norm=0.5), plan=plan, compute_dtype=torch.float32,
                device="cpu", seed=3) as engine:
        losses = []
        for _ in range(steps):
            ids = torch.randint(0, CONFIG.vocab_size, (4, 12), generator=gen)
            engine.time_next_step()
            losses.append(engine.step(ids, ids).item())
        return losses, engine.state_dict(), engine.last_step_breakdown


@pytest.mark.parametrize("in_place,thread", [(True, "compute"), (True, "worker"), (False, "compute")])
def test_in_place_and_on_the_compute_thread_train_as_with_copies_and_the_worker(in_place: bool, thread: str) -> None:
    """Three steps with tied embeddings, a kept and two recomputed layers over two micro-batches: the losses and
    every weight bitwise as with the weights copied into slots and AdamW on its worker thread."""
    losses, weights, _ = _train(BASE)
    got_losses, got, _ = _train(BASE.replace(compute_in_place=in_place, adam_thread=thread))
    assert got_losses == losses
    assert all(torch.equal(got[k], v) for k, v in weights.items())


def test_in_place_holds_no_buffer_and_copies_nothing() -> None:
    """In place the slots and gradient buffers are empty, the tied embedding's gradient is its host gradients, and
    the step's breakdown has no copy in it (checkpoints on the device); with copies the same step has both."""
    plan = BASE.replace(compute_in_place=True, adam_thread="compute")
    with Engine(CONFIG, OptimizerConfig(max_grad_norm=1.0), plan=plan, compute_dtype=torch.float32,
                device="cpu") as engine:
        ex, store = engine.executor, engine.store
        assert sum(b.numel() for b in ex.slots.buffers) == 0
        assert sum(b.numel() for b in ex.grad_buffers.buffers) == 0
        assert ex.tied_grad is not None
        assert ex.tied_grad.untyped_storage().data_ptr() == store.grads.tensor.untyped_storage().data_ptr()
    for copies in (False, True):
        _, _, b = _train(BASE.replace(compute_in_place=not copies, adam_thread="compute", checkpoints="device"), steps=2)
        assert (b["h2d_busy_s"] > 0) is copies and (b["d2h_busy_s"] > 0) is copies


def test_on_the_compute_thread_every_update_is_done_when_step_returns() -> None:
    """No AdamW thread; when ``step`` returns (no ``synchronize``) every block's update of that step is logged,
    each after the step's backward, in forward order, the time it took shown as exposed AdamW and added to compute
    in the roofline."""
    plan = BASE.replace(compute_in_place=True, adam_thread="compute")
    workers = lambda: {t for t in threading.enumerate() if t.name == "megatrain-adamw"}  # noqa: E731
    before = workers()  # other tests' engines may not be collected yet
    with Engine(CONFIG, OptimizerConfig(max_grad_norm=1.0), plan=plan, compute_dtype=torch.float32,
                device="cpu") as engine:
        assert workers() <= before
        engine.event_log.enabled = True
        ids = torch.randint(0, CONFIG.vocab_size, (4, 12))
        engine.step(ids, ids)
        engine.time_next_step()
        engine.step(ids, ids)
        log = [(e.op, e.block) for e in engine.event_log.entries if e.step == 2]
        ends = [block for kind, block in log if kind == "adam_end"]
        assert ends == sorted(ends) == list(range(len(engine.templates.blocks)))
        last_compute = max(i for i, (kind, _) in enumerate(log) if kind == "compute")
        assert min(i for i, (kind, _) in enumerate(log) if kind == "adam_begin") > last_compute
        b = engine.last_step_breakdown
        assert b["adam_exposed_s"] >= b["adam_busy_s"] > 0
        assert b["roofline_s"] == pytest.approx(b["compute_s"] + b["adam_busy_s"])  # in series: no overlap


@pytest.mark.parametrize("fields,says", [
    (dict(compute_in_place=True, optimizer_mode="eager"), "eager updates take gradients from slabs"),
    (dict(compute_in_place=True, expert_group_size=2), "expert groups"),
    (dict(compute_in_place=True, spill="all", spill_dir="/tmp/x"), "the master or the gradients spill"),
    (dict(compute_in_place=True, spill="blocks", spill_dir="/tmp/x", spill_blocks={"grads": [1]}), "gradients spill"),
    (dict(compute_in_place="yes"), "must be true or false"),
    (dict(adam_thread="compute", spill="optimizer", spill_dir="/tmp/x"), "cannot wait for spill I/O"),
    (dict(adam_thread="main"), "must be one of 'worker', 'compute'"),
])
def test_plans_that_cannot_compute_in_place_are_refused_in_one_line(fields: dict, says: str) -> None:
    with pytest.raises(PlanError, match=says) as e:
        Plan(**fields)
    assert "\n" not in str(e.value)
    # what may: m and v spilled with the masters and gradients in RAM, and a plan file without either field
    assert Plan(compute_in_place=True, spill="optimizer", spill_dir="/tmp/x").compute_in_place
    assert Plan.from_dict({"version": 1, "micro_batch_size": 2}).adam_thread == "worker"


def test_a_checkpoint_of_a_cpu_plan_resumes_without_its_cpu_choices_where_they_do_not_apply(tmp_path,
                                                                                              monkeypatch) -> None:
    """A checkpoint records its plan; resumed on a CPU it keeps compute in place and AdamW on the compute thread,
    and where they do not apply (a GPU, or here several ranks) they are turned off, where a
    plan given with them would be refused."""
    from megatrain.runtime import engine_arguments
    from megatrain.runtime.engine_arguments import resumed_plan

    plan = BASE.replace(compute_in_place=True, adam_thread="compute")
    with Engine(CONFIG, OptimizerConfig(max_grad_norm=1.0), plan=plan, compute_dtype=torch.float32,
                device="cpu") as engine:
        ids = torch.randint(0, CONFIG.vocab_size, (4, 12))
        engine.step(ids, ids)
        engine.save_checkpoint(tmp_path, blocking=True)
    with Engine.load_checkpoint(tmp_path, device="cpu") as resumed:
        assert resumed.plan == plan
    assert resumed_plan(plan, "cpu") == plan
    monkeypatch.setattr(engine_arguments, "join_ranks", lambda: object())  # this process one of several ranks
    moved = resumed_plan(plan, "cpu")
    assert (moved.compute_in_place, moved.adam_thread) == (False, "worker")
    assert moved.replace(compute_in_place=True, adam_thread="compute") == plan  # nothing else changed


def test_a_failed_update_on_the_compute_thread_is_raised_by_every_later_wait(monkeypatch) -> None:
    """An update that fails on the compute thread raises from ``step``, and every later call that would wait for
    that block's update raises too (as with the worker thread), instead of waiting for ever."""
    from megatrain.runtime.optim import cpu_adamw

    plan = BASE.replace(compute_in_place=True, adam_thread="compute")
    engine = Engine(CONFIG, OptimizerConfig(max_grad_norm=1.0), plan=plan, compute_dtype=torch.float32, device="cpu")
    ids = torch.randint(0, CONFIG.vocab_size, (4, 12))
    engine.step(ids, ids)

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("injected")
    monkeypatch.setattr(cpu_adamw, "_fused_adamw", broken)
    with pytest.raises(OSError, match="injected"):
        engine.step(ids, ids)
    outcome: list[BaseException] = []

    def later() -> None:
        try:
            engine.synchronize()
        except BaseException as e:  # noqa: BLE001 - what the call raised is the test's subject
            outcome.append(e)
    waiter = threading.Thread(target=later, daemon=True)
    waiter.start()
    waiter.join(timeout=30)
    assert not waiter.is_alive(), "synchronize() waits for ever after a failed update"
    assert len(outcome) == 1 and "injected" in str(outcome[0])
    engine.close()
