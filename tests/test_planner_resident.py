"""The planner's optimizer state on the device ([Note: resident trade] in planner/choice/plan_variants.py): the memory
model's 16 bytes a resident parameter by hand, the cost model's traffic and CPU AdamW without those blocks, the
search's trade against kept layers on the H200 preset, and ``megatrain-plan plan``'s account of it."""
from __future__ import annotations

import json

import pytest

from megatrain.planner.commands import cli
from megatrain.planner.costs import cost_model, memory_model, resident_blocks
from megatrain.planner.profiling import hardware
from megatrain.planner.shapes import model_shapes
from megatrain.planner.choice import plan_variants, search
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload

LLAMA_1B = model_shapes.resolve("shape:Llama-3.2-1B")
H200 = hardware.resolve("H200")
WORK = Workload(2048, 16)


def _terms(plan: Plan) -> dict[str, int]:
    return {c.name: c.nbytes for c in memory_model.estimate(LLAMA_1B, WORK, plan, H200).components}


def test_resident_blocks_move_16_bytes_a_parameter_from_ram_to_the_device_by_hand() -> None:
    m = LLAMA_1B
    E, Lw, H = m.numel_embedding, m.numel_layer, m.numel_head
    host, some = _terms(Plan()), _terms(Plan(resident_blocks=(0, 1, 2)))
    Nr = E + 2 * Lw
    assert some["resident optimizer state"] == 16 * Nr
    assert host["fp32 master"] - some["fp32 master"] == 4 * Nr == host["Adam m"] - some["Adam m"]
    assert host["fp32 grads (full arena)"] - some["fp32 grads (full arena)"] == 4 * Nr
    assert host["compute-dtype shadow"] - some["compute-dtype shadow"] == 2 * Nr
    assert some["tied embedding grad"] == 0 < host["tied embedding grad"] == 4 * E  # the embedding's own buffer
    every = _terms(Plan(resident_blocks=tuple(range(m.num_layers + 2))))
    assert every["grad accumulators"] == 0 and "fp32 master" not in every and every["fp32 grads (full arena)"] == 0
    assert every["resident optimizer state"] == 16 * m.numel_total


def test_a_resident_block_crosses_no_link_and_leaves_the_cpu_adamw() -> None:
    m = LLAMA_1B
    plan = search.search(m, WORK, H200).best.plan.replace(resident_blocks=(), kept_layers=(), checkpoints="device",
                                                          weights_cast="host")
    host = cost_model.estimate(m, WORK, plan, H200)
    every = cost_model.estimate(m, WORK, plan.replace(resident_blocks=tuple(range(m.num_layers + 2))), H200)
    # bf16 weights: the tied embedding loaded twice, each layer twice, the head's norm once; fp32 gradients once
    assert host.h2d_bytes == 2 * (2 * m.numel_embedding + 2 * m.num_layers * m.numel_layer + m.numel_head)
    assert host.d2h_bytes == 4 * (m.numel_embedding + m.num_layers * m.numel_layer)
    assert every.h2d_bytes == 0 == every.d2h_bytes
    assert every.forward.adam_s == 0 < host.forward.adam_s  # deferred: the CPU AdamW has nothing to do
    assert every.optimizer_exposed_seconds == 0


def test_the_search_trades_resident_blocks_against_kept_layers_on_the_h200() -> None:
    """Clipping on, 2048 x 16: the 1.24B shape keeps optimizer state on the GPU (the CPU AdamW's work hidden), and
    the plans it timed with none and with every block are slower; a CPU device keeps none."""
    best = search.search(LLAMA_1B, WORK, H200).best
    assert best.plan.resident_blocks and best.cost.optimizer_exposed_seconds == 0
    fit, _ = search.feasible_choices(LLAMA_1B, WORK, H200)
    none = min(c.cost.step_seconds for c in fit if not c.plan.resident_blocks)
    assert best.cost.step_seconds < none
    assert any(len(c.plan.resident_blocks) == LLAMA_1B.num_layers + 2 for c in fit)
    on_cpu = plan_variants.variants(LLAMA_1B, WORK, best.plan.replace(resident_blocks=()), lambda p: (0,), False)
    assert not any(p.resident_blocks for p in on_cpu)  # a CPU device: none tried
    bf16_state = Workload(2048, 16, optimizer_state="bf16")  # the device AdamW keeps fp32 state only
    assert not search.search(LLAMA_1B, bf16_state, H200).best.plan.resident_blocks


def test_megatrain_plan_says_how_many_blocks_and_the_timed_alternatives(capsys) -> None:
    args = ["plan", "--model", "shape:Llama-3.1-8B", "--hardware", "H200", "--seq-len", "4096", "--batch", "16"]
    assert cli.main(args) == 0
    assert "optimizer state on the GPU: " in capsys.readouterr().out
    assert cli.main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = data["resident_alternatives"]
    assert {r["resident_blocks"] for r in rows} >= {0, 34} and any(0 < r["resident_blocks"] < 34 for r in rows)
    some = next(r for r in rows if 0 < r["resident_blocks"] < 34)  # kept layers traded for resident blocks
    assert some["kept_layers"] < next(r for r in rows if r["resident_blocks"] == 0)["kept_layers"]
    chosen = len(data["plan"].get("resident_blocks", []))
    fastest = min(rows, key=lambda r: r["step_seconds"])
    assert fastest["resident_blocks"] == chosen or fastest["step_seconds"] >= data["time"]["step_seconds"] * 0.99


def test_more_resident_blocks_start_from_the_plans_own() -> None:
    """``most_resident`` and ``traded`` from a plan whose first blocks host RAM needs resident: a count below it
    does not fit (RAM), one above a ceiling neither (the GPU); the answer is the ceiling, never fewer than the plan's
    own (a bisection from none had walked down into the RAM-short counts and answered none)."""
    m = LLAMA_1B  # 18 blocks
    # (host RAM, GPU memory) beyond their budgets, in blocks: fits from 5 to 8 resident blocks
    excess = lambda p: (5 - len(p.resident_blocks), len(p.resident_blocks) - 8)  # noqa: E731
    five = Plan(resident_blocks=resident_blocks.first_blocks(m, 5))
    assert resident_blocks.most_resident(m, five, excess).resident_blocks == tuple(range(8))
    assert resident_blocks.most_resident(m, five, lambda p: (len(p.resident_blocks) - 5,)) == five
    kept = five.replace(kept_layers=(15, 14, 13, 12))  # fewer kept layers: room for more blocks, from the five
    traded = plan_variants.traded(m, WORK, kept, lambda p: (5 - len(p.resident_blocks),
                                                            len(p.resident_blocks) - 12 + len(p.kept_layers)), True)
    assert traded and all(len(p.resident_blocks) == 12 - len(p.kept_layers) for p in traded)


def test_the_device_adamw_runs_at_the_profiles_measured_rate_by_hand() -> None:
    """A profile that measured the GPU's fused AdamW (``device_adam_gbps``) times a resident block's update at its
    figure, 28 bytes a parameter and 8 more with clipping (the gradient multiplied by the clip coefficient first);
    one without it (a preset, an older profile) at DEVICE_ADAM_GBPS."""
    m = LLAMA_1B
    plan = Plan(resident_blocks=(0, 1, 2), optimizer_mode="deferred")  # the updates after backward, on the compute
    assert H200.device_adam_gbps == 0 and resident_blocks.device_adam_gbps(H200) == resident_blocks.DEVICE_ADAM_GBPS
    assumed = cost_model.estimate(m, WORK, plan, H200)
    measured = cost_model.estimate(m, WORK, plan, H200.replace(device_adam_gbps=800.0))
    Nr = m.numel_embedding + 2 * m.numel_layer
    slower = Nr * (28 + 8) * (1 / 800e9 - 1 / (resident_blocks.DEVICE_ADAM_GBPS * 1e9))  # clipping: 8 B more
    eager = Plan(resident_blocks=(0, 1, 2), optimizer_mode="eager")  # without clipping: 28 B a parameter
    unclipped = Workload(2048, 16, clipping=False)
    assert (cost_model.estimate(m, unclipped, eager, H200.replace(device_adam_gbps=800.0)).backward.compute_s
            - cost_model.estimate(m, unclipped, eager, H200).backward.compute_s) == pytest.approx(
        Nr * 28 * (1 / 800e9 - 1 / (resident_blocks.DEVICE_ADAM_GBPS * 1e9)), rel=1e-9)
    assert measured.backward.compute_s - assumed.backward.compute_s == pytest.approx(slower, rel=1e-9)
    assert measured.forward == assumed.forward
