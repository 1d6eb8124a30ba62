"""The public API as a user drives it: training, bf16 with fp32 masters, weights in and out."""
from __future__ import annotations

import torch

from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)


def _data(steps=30, batch=4, seq=16):
    # A learnable pattern: each sequence counts up from a random start (mod vocab).
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        start = torch.randint(0, 64, (batch, 1), generator=gen)
        ids = (start + torch.arange(seq)) % 64
        yield ids, ids


def test_bf16_training_learns_and_keeps_fp32_masters():
    engine = Engine(CONFIG, OptimizerConfig(lr=3e-3, max_grad_norm=1.0), compute_dtype=torch.bfloat16, device="cpu")
    try:
        losses = [engine.step(ids, labels).item() for ids, labels in _data()]
        assert losses[-1] < 0.6 * losses[0], losses
        sd = engine.state_dict()
        assert all(t.dtype == torch.float32 for t in sd.values())
        # The masters hold more than bf16 can: updates smaller than a bf16 ulp were not lost.
        w = sd["model.layers.0.mlp.up_proj.weight"]
        assert not torch.equal(w, w.bfloat16().float())
        state = engine.optimizer_state_dict()["model.layers.0.mlp.up_proj.weight"]
        assert state["exp_avg"].dtype == torch.float32 and float(state["step"]) == 30
    finally:
        engine.close()


def test_bf16_close_to_fp32():
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        with Engine(CONFIG, OptimizerConfig(lr=1e-3), compute_dtype=dtype, device="cpu", seed=3) as engine:
            losses[dtype] = [engine.step(i, l).item() for i, l in _data(steps=5)]
    for a, b in zip(losses[torch.float32], losses[torch.bfloat16]):
        assert abs(a - b) < 0.02 * a


def test_state_dict_round_trip_between_engines():
    a = Engine(CONFIG, device="cpu", compute_dtype=torch.float32, seed=1)
    b = Engine(CONFIG, device="cpu", compute_dtype=torch.float32, seed=2)
    try:
        ids = torch.randint(0, 64, (2, 10))
        assert not torch.equal(a.logits(ids), b.logits(ids))
        b.load_state_dict(a.state_dict())
        assert torch.equal(a.logits(ids), b.logits(ids))
    finally:
        a.close()
        b.close()


def test_seed_decides_initial_weights():
    with Engine(CONFIG, device="cpu", seed=5) as a, Engine(CONFIG, device="cpu", seed=5) as b:
        sa, sb = a.state_dict(), b.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
        assert float(sa["model.norm.weight"].mean()) == 1.0
        assert abs(float(sa["model.embed_tokens.weight"].std()) - CONFIG.initializer_range) < 0.002


def test_plans_agree_on_the_numbers():
    """Checkpoint placement, slots, prefetch and optimizer mode change nothing (fp32, untied, same micro-batches)."""
    opt = OptimizerConfig(lr=1e-3, max_grad_norm=None)
    results = []
    for plan in (Plan(optimizer_mode="eager"), Plan(num_slots=4, prefetch_depth=3, micro_batch_size=1,
                                                     checkpoints="host", optimizer_mode="deferred")):
        with Engine(CONFIG, opt, plan=plan, compute_dtype=torch.float32, device="cpu") as engine:
            losses = [engine.step(i, l) for i, l in _data(steps=4)]
            results.append((torch.stack(losses), engine.state_dict()))
    (la, sa), (lb, sb) = results
    assert torch.equal(la, lb)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_parameter_count_matches_hf_formula():
    h, i, v, L = 32, 64, 64, 2
    kv = 2 * (32 // 4)
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * i + 2 * h
    with Engine(CONFIG, device="cpu") as engine:
        assert engine.num_parameters == v * h + L * per_layer + h + v * h


def test_step_breakdown_accounts_for_the_step():
    ids = torch.randint(0, 64, (4, 16))
    for plan, host_ckpt in ((Plan(), False), (Plan(checkpoints="host"), True)):
        with Engine(CONFIG, OptimizerConfig(max_grad_norm=1.0), plan=plan, compute_dtype=torch.float32,
                    device="cpu") as engine:
            assert engine.last_step_breakdown is None
            engine.step(ids, ids)
            assert engine.last_step_breakdown is None  # not asked for: the step recorded no timing
            engine.time_next_step()
            engine.step(ids, ids)
            b = engine.last_step_breakdown
            parts = ("compute_s", "h2d_exposed_s", "d2h_exposed_s", "ckpt_traffic_s", "adam_exposed_s", "disk_exposed_s")
            assert all(b[k] >= 0 for k in parts) and b["step_s"] > 0
            assert b["disk_exposed_s"] == b["disk_read_busy_s"] == b["disk_write_busy_s"] == 0  # nothing spills
            assert abs(sum(b[k] for k in parts) - b["step_s"]) < 1e-6  # on a CPU the parts add up to the step
            assert b["h2d_exposed_s"] > 0 and b["d2h_exposed_s"] > 0
            assert (b["ckpt_traffic_s"] > 0) == host_ckpt
            # Busy time: on a CPU the copies' host time, which holds their exposed part.
            assert b["h2d_busy_s"] >= b["h2d_exposed_s"] > 0
            assert b["d2h_busy_s"] >= b["d2h_exposed_s"] > 0


def test_roofline_counts_the_adamw_workers_update_time(monkeypatch):
    """adam_busy_s is the worker's update time for a whole step: slow every fused AdamW call down by a
    known amount and it must grow by at least that; the roofline is the largest resource."""
    import time as _time

    calls = []
    fused = torch._fused_adamw_

    def slow(*args, **kwargs):
        calls.append(1)
        _time.sleep(0.02)
        return fused(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", slow)
    ids = torch.randint(0, 64, (4, 16))
    for mode in ("eager", "deferred"):
        with Engine(CONFIG, OptimizerConfig(max_grad_norm=None), plan=Plan(optimizer_mode=mode),
                    compute_dtype=torch.float32, device="cpu") as engine:
            engine.step(ids, ids)
            engine.synchronize()
            calls.clear()
            engine.time_next_step()
            engine.step(ids, ids)
            engine.synchronize()  # the step's updates have all finished
            b = engine.last_step_breakdown
            assert b["adam_busy_s"] >= 0.02 * len(calls) > 0
            resources = (b["compute_s"], b["h2d_busy_s"], b["d2h_busy_s"], b["adam_busy_s"], b["disk_busy_s"])
            assert b["roofline_s"] == max(resources)
            assert b["roofline_ratio"] == b["step_s"] / b["roofline_s"]


def test_breakdown_has_the_disk_when_state_spills(tmp_path, monkeypatch):
    """With spill="all" in fp32 every read and write goes to the disk: slow each read down by a known amount
    and the disk's busy and exposed seconds show it, the exposed parts still add up to the step, and the
    roofline takes the disk's busy time. Both halves of the step keep the disk busy: the forward the previous
    step's deferred update and its I/O, the backward the recompute's reads of the masters."""
    import os as _os
    import time as _time

    preadv = _os.preadv

    def slow(*args, **kwargs):
        _time.sleep(0.01)
        return preadv(*args, **kwargs)

    ids = torch.randint(0, 64, (4, 16))
    plan = Plan(spill="all", spill_dir=str(tmp_path), spill_staging=2, spill_chunk_bytes=4096, io_backend="posix")
    with Engine(CONFIG, OptimizerConfig(max_grad_norm=1.0), plan=plan, compute_dtype=torch.float32,
                device="cpu") as engine:
        engine.step(ids, ids)
        monkeypatch.setattr(_os, "preadv", slow)
        engine.time_next_step()
        engine.step(ids, ids)
        b = engine.last_step_breakdown
    parts = ("compute_s", "h2d_exposed_s", "d2h_exposed_s", "ckpt_traffic_s", "adam_exposed_s", "disk_exposed_s")
    assert abs(sum(b[k] for k in parts) - b["step_s"]) < 1e-6
    assert b["disk_read_busy_s"] >= 0.01 and b["disk_exposed_s"] >= 0.01  # the update and the loads wait for reads
    # (a forward load takes the master its update writes; the backward's loads read theirs, slowly)
    assert b["disk_exposed_s"] == b["disk_load_exposed_s"] + b["disk_adam_exposed_s"] and b["disk_load_exposed_s"] > 0
    assert b["disk_busy_s"] >= max(b["disk_read_busy_s"], b["disk_write_busy_s"]) > 0
    assert b["roofline_s"] >= b["disk_busy_s"]
    assert 0 < b["forward_s"] < b["step_s"]
    assert b["disk_busy_forward_s"] >= 0.01 and b["disk_busy_s"] - b["disk_busy_forward_s"] >= 0.01


def test_without_a_plan_the_first_step_sets_the_micro_batch(tmp_path):
    """No plan: the default plan's micro-batch is the first step's batch (one micro-batch, never split), the same
    bits as that plan given explicitly (AdamW on its worker thread, weights copied); a checkpoint before any step leaves it open for the resumed engine."""
    opt = OptimizerConfig(lr=1e-3, max_grad_norm=1.0)
    batches = list(_data(steps=3, batch=4))
    with Engine(CONFIG, opt, compute_dtype=torch.float32, device="cpu") as own:
        own.save_checkpoint(tmp_path / "early", blocking=True)
        assert own.plan.micro_batch_size == 1  # open until a step
        losses = [own.step(ids, labels).item() for ids, labels in batches]
        # ... and keeps every layer's activations, which fit ([Note: kept layers]; the planner's choice); on a CPU
        # device AdamW runs on the compute thread and compute in place, with the same bits as the copies and the
        # worker thread (below)
        assert own.plan == Plan(optimizer_mode="deferred", micro_batch_size=4, kept_layers=(0, 1),
                                adam_thread="compute", compute_in_place=True)
        weights = own.state_dict()
    with Engine(CONFIG, opt, plan=Plan(micro_batch_size=4, kept_layers=(0, 1)), compute_dtype=torch.float32,
                device="cpu") as given:
        assert [given.step(ids, labels).item() for ids, labels in batches] == losses
        assert all(torch.equal(weights[k], v) for k, v in given.state_dict().items())
    with Engine.load_checkpoint(tmp_path / "early") as resumed:
        assert [resumed.step(ids, labels).item() for ids, labels in batches] == losses
        assert resumed.plan.micro_batch_size == 4


def test_without_a_plan_the_first_step_keeps_what_memory_allows(monkeypatch):
    """No plan: the layers kept are the planner's ``default_kept_layers`` for the first step's batch and the memory
    free then: all of them with room, fewer as it shrinks, none with almost nothing free; training is the same
    bits whichever are kept."""
    import psutil

    from megatrain.planner.costs import memory_model
    from megatrain.planner.shapes import model_shapes
    from megatrain.planner.costs.kept_layers import DEFAULT_KEEP_SHARE
    from megatrain.planner.shapes.workload import Workload

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)
    shape = model_shapes.from_config(config.to_dict())
    work = Workload(16, 4, "float32", clipping=True)

    def needs(k: int) -> int:
        plan = Plan(micro_batch_size=4, kept_layers=tuple(range(4 - k, 4)))
        return memory_model.activation_bytes(shape, work, plan)

    (ids, labels), = _data(steps=1, batch=4)
    losses = set()
    for free, kept in [(2**40, (0, 1, 2, 3)), (int(needs(2) / DEFAULT_KEEP_SHARE) + 1, (2, 3)), (1, ())]:
        # the memory free varies; the machine's total (what a batch must fit at all, batch_limits.py) does not
        monkeypatch.setattr(psutil, "virtual_memory",
                            lambda free=free: type("VM", (), {"available": free, "total": 2**40})())
        with Engine(config, OptimizerConfig(lr=1e-3, max_grad_norm=1.0), compute_dtype=torch.float32,
                    device="cpu") as engine:
            losses.add(engine.step(ids, labels).item())
            engine.step(ids, labels)
            assert engine.plan.kept_layers == kept
            losses.add(engine.step(ids, labels).item())
    assert len(losses) == 2  # the first and third step's losses, the same for every choice
