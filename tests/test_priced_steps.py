"""The cost model keeps its estimates by the plan fields a step's time reads ([Note: priced steps] in
planner/costs/cost_model.py): each field it leaves out, varied on dense and sparse plans with a GPU and without,
prices the same step (``price``, nothing kept), and what it keeps answers as ``price`` does."""
from __future__ import annotations

import dataclasses

import pytest

from megatrain.planner.costs import cost_model
from megatrain.planner.profiling import hardware as hwmod
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.planner.shapes import model_shapes
from megatrain.plan.plan import Plan, SpillBlocks
from megatrain.planner.shapes.workload import Workload

DENSE = model_shapes.resolve("shape:Llama-3.2-1B")
SPARSE = model_shapes.resolve("shape:Qwen3-30B-A3B")
WORK = Workload(seq_len=1024, batch=4, spill_dir="/tmp/spill")
GPU = dataclasses.replace(hwmod.preset("H200"), disk_read_gbps=3.0, disk_write_gbps=2.0)
CPU = HardwareProfile(gpu_name="cpu", gpu_mem_bytes=0, h2d_gbps=5.0, d2h_gbps=5.0, duplex_gbps=5.0,
                      matmul_tflops={"float32": 0.1, "bfloat16": 0.05}, cpu_adam_params_per_s=1e9,
                      host_ram_bytes=64 << 30, host_available_bytes=60 << 30, cores=2, disk_read_gbps=1.0,
                      disk_write_gbps=0.5)
# a plan of each kind the cost model prices apart: nothing spilled, some blocks' state spilled, all of it
PLANS = (Plan(checkpoints="host"),
         Plan(spill="blocks", spill_dir="/tmp/spill", spill_blocks=SpillBlocks(exp_avg=(3, 4), exp_avg_sq=(3, 4),
                                                                             master=(4,))),
         Plan(spill="all", spill_dir="/tmp/spill", num_slots=3, prefetch_depth=2, kept_layers=(0, 1)))


def _varied(model: model_shapes.ModelShape) -> dict[str, object]:
    """Each field the cost model leaves out, and a value for it other than the plans' own."""
    return {"mlp_tile_tokens": 256, "attention_tile_tokens": 128, "checkpoint_piece_tokens": 64,
            "expert_group_size": 4 if model.experts.num_experts else 0, "spill_dir": "/tmp/elsewhere",
            "io_backend": "posix", "io_threads": 9, "io_direct": False, "io_direct_reads": True,
            "workload": WORK.fingerprint(model), "spill_staging": 7, "spill_chunk_bytes": 4 << 20}


def test_every_left_out_field_is_a_plan_field_and_varied_here() -> None:
    names = {f.name for f in dataclasses.fields(Plan)}
    assert cost_model.UNTIMED_FIELDS < cost_model.UNTIMED_WITH_GPU <= names
    assert set(_varied(DENSE)) == cost_model.UNTIMED_WITH_GPU


@pytest.mark.parametrize("model", [DENSE, SPARSE], ids=["dense", "sparse"])
@pytest.mark.parametrize("hw", [GPU, CPU], ids=["gpu", "cpu"])
def test_the_step_reads_none_of_the_fields_left_out(model: model_shapes.ModelShape, hw: HardwareProfile) -> None:
    left_out = cost_model.UNTIMED_FIELDS if hw.device_is_host else cost_model.UNTIMED_WITH_GPU
    for plan in PLANS:
        base = cost_model.price(model, WORK, plan, hw)
        for name, value in _varied(model).items():
            if name in left_out:
                assert cost_model.price(model, WORK, plan.replace(**{name: value}), hw) == base, name


def test_without_a_gpu_the_staging_sets_time_the_step_and_are_kept_apart() -> None:
    """A spilled CPU step's read-ahead is bounded by the staging sets (spill_timing), so they stay in the key."""
    plan = PLANS[2]
    one, many = plan.replace(spill_staging=1), plan.replace(spill_staging=64)
    assert cost_model.price(DENSE, WORK, one, CPU) != cost_model.price(DENSE, WORK, many, CPU)
    for p in (one, many, one):
        assert cost_model.estimate(DENSE, WORK, p, CPU) == cost_model.price(DENSE, WORK, p, CPU)


def test_a_kept_estimate_is_the_priced_one_for_its_model_and_hardware() -> None:
    """Kept by identity: an equal copy of the hardware, or another profile, is priced as its own."""
    plan = PLANS[1]
    first = cost_model.estimate(DENSE, WORK, plan, GPU)
    assert first == cost_model.price(DENSE, WORK, plan, GPU)
    assert cost_model.estimate(DENSE, WORK, plan.replace(spill_staging=5), GPU) is first
    slower = dataclasses.replace(GPU, h2d_gbps=GPU.h2d_gbps / 4)
    assert cost_model.estimate(DENSE, WORK, plan, slower) == cost_model.price(DENSE, WORK, plan, slower) != first
    assert cost_model.estimate(DENSE, WORK, plan, dataclasses.replace(GPU)) == first
    assert cost_model.estimate(DENSE, WORK, plan, GPU, world=2) == cost_model.price(DENSE, WORK, plan, GPU, 2)
