"""The planner's per-block spill placement: memory and disk terms checked by hand, the fill order, and a search
that fills RAM first and the disk with the rest, so RAM and disk together set the largest model."""
from __future__ import annotations

import dataclasses
import json

import pytest

from megatrain.planner.costs import cost_model, memory_model, spill_placement, step_traffic
from megatrain.planner.choice import candidate_fit, search, sizing
from megatrain.plan.buffer_kinds import spill_block_bytes, spill_chunk_numel
from megatrain.planner.profiling.hardware import GiB
from megatrain.planner.shapes.model_shapes import PRESETS
from megatrain.plan.plan import Plan, SpillBlocks
from megatrain.planner.shapes.workload import Workload
from test_planner_answers import CPU_24G

HW, _ = sizing.with_disk(CPU_24G)  # 1 GB/s read and write
ONE_B = PRESETS["shape:Llama-3.2-1B"]    # tied: blocks 0 embedding, 1..16 layers, 17 head (its norm)


def _rows(model, work, plan) -> dict[str, int]:
    return {c.name: c.nbytes for c in memory_model.estimate(model, work, plan, HW).components}


def test_memory_terms_of_a_partial_placement_by_hand() -> None:
    m, L = ONE_B, ONE_B.num_layers
    E, Lw, H, N = m.numel_embedding, m.numel_layer, m.numel_head, m.numel_total
    blocks = SpillBlocks(master=(0,), exp_avg=(L, L + 1), exp_avg_sq=(L, L + 1), grads=(1, 2))
    plan = Plan(spill="blocks", spill_blocks=blocks, spill_dir="/d", spill_staging=3)
    rows = _rows(m, Workload(128, 1, "fp32"), plan)
    r = spill_block_bytes
    assert rows["fp32 master"] == 4 * (N - E) and rows["fp32 master (spill file)"] == r(E)
    assert rows["Adam m"] == rows["Adam v"] == 4 * (N - Lw - H)
    assert rows["Adam m (spill file)"] == rows["Adam v (spill file)"] == r(Lw) + r(H)
    assert rows["fp32 grads (full arena)"] == 4 * (N - 2 * Lw) and rows["fp32 grads (spill file)"] == 2 * r(Lw)
    Ck = spill_chunk_numel(m.numel_largest_block, plan.spill_chunk_bytes)
    assert rows["spill staging"] == 3 * 4 * Ck * 4          # P x k x Ck x 4, all four kinds have a block on disk
    assert rows["fp32 grad slabs"] == 2 * Ck * 4
    # Every block on disk is every block of the shorthand: "blocks" naming all of m and v is "optimizer".
    every = tuple(range(L + 2))
    same = Plan(spill="blocks", spill_blocks=SpillBlocks(exp_avg=every, exp_avg_sq=every), spill_dir="/d")
    assert _rows(m, Workload(128, 1, "fp32"), same) == _rows(m, Workload(128, 1, "fp32"),
                                                             Plan(spill="optimizer", spill_dir="/d"))


def test_disk_traffic_of_a_partial_placement_by_hand() -> None:
    """fp32: each spilled (block, kind) read and written once by AdamW (grads: written in backward, read by
    AdamW), plus the loads of the blocks whose master spills: the tied embedding twice, a layer twice; on a CPU
    with deferred updates each block's first forward load takes its update's master instead (the tap)."""
    m, r = ONE_B, spill_block_bytes
    E, Lw = m.numel_embedding, m.numel_layer
    plan = Plan(spill="blocks", spill_blocks=SpillBlocks(master=(0, 3), exp_avg=(5,), grads=(3,)), spill_dir="/d")
    read, write = step_traffic.disk_traffic(m, Workload(128, 1, "fp32"), plan)
    files = r(E) + r(Lw) + r(Lw) + r(Lw)
    assert write == files and read == files + 2 * E * 4 + 2 * Lw * 4
    bf16_read, _ = step_traffic.disk_traffic(m, Workload(128, 1, "bf16"), plan)
    assert bf16_read == files                             # bf16 loads come from the RAM shadow
    tapped, _ = step_traffic.disk_traffic(m, Workload(128, 1, "fp32"), plan, tapped=True)
    assert tapped == files + E * 4 + Lw * 4               # the tied head's re-load, the layer's backward load
    est = cost_model.estimate(m, Workload(128, 1, "fp32"), plan, HW)   # a CPU, deferred: tapped
    assert est.disk_seconds == pytest.approx(tapped / 1e9 + write / 1e9)


def test_partial_placements_cost_between_none_and_all() -> None:
    m, work = ONE_B, Workload(128, 1, "fp32", clipping=False)
    for mode in ("eager", "deferred"):
        base = Plan(optimizer_mode=mode)
        steps = [cost_model.estimate(m, work, spill_placement.at_level(base.replace(spill_dir="/d"), m, level), HW)
                 for level in (0, 9, 18, 27, spill_placement.fill_levels(m, mode == "deferred"))]
        times = [s.step_seconds for s in steps]
        # between none and all, not always rising: on a CPU a load of a spilled master reads the disk straight into
        # its slot, sparing the compute thread the copy from RAM, so where the CPU is the bottleneck a few more
        # masters on disk can be a shade faster (eager: 64.2 s with m and v spilled, 63.2 s with 9 masters too)
        assert all(times[0] * (1 - 1e-12) <= t <= times[-1] * (1 + 1e-12) for t in times), (mode, times)
        assert times[0] < times[-1], (mode, times)
        disk = [s.disk_read_bytes for s in steps]
        assert disk == sorted(disk) and disk[0] == 0


def test_fill_order_m_and_v_then_masters_then_grads_from_the_last_block() -> None:
    m, nb = ONE_B, ONE_B.num_layers + 2
    plan = Plan(spill_dir="/d")
    assert spill_placement.at_level(plan, m, 0).spill == "none"
    one = spill_placement.at_level(plan, m, 1)
    assert one.spill_blocks == SpillBlocks(exp_avg=(nb - 1,), exp_avg_sq=(nb - 1,))
    assert spill_placement.at_level(plan, m, nb).spill == "optimizer"
    more = spill_placement.at_level(plan, m, nb + 2).spill_blocks
    assert more is not None and more.master == (nb - 2, nb - 1) and more.exp_avg == tuple(range(nb)) and not more.grads
    grads = spill_placement.at_level(plan, m, 2 * nb + 1).spill_blocks
    assert grads is not None and grads.grads == (nb - 1,) and grads.master == tuple(range(nb))
    assert spill_placement.at_level(plan, m, 3 * nb).spill == "all"
    assert spill_placement.fill_levels(m, deferred=False) == 2 * nb   # eager: no gradient arena to spill
    assert spill_placement.at_level(plan.replace(optimizer_mode="eager"), m, 2 * nb).spill == "all"
    assert spill_placement.label(one) == "m, v of 1 block"


def _level(model, plan: Plan) -> int:
    nb = model.num_layers + 2
    if plan.spill in ("none", "optimizer", "all"):
        return {"none": 0, "optimizer": nb, "all": spill_placement.fill_levels(model, True)}[plan.spill]
    b = plan.spill_blocks
    assert b is not None and b.exp_avg == b.exp_avg_sq
    return len(b.exp_avg) + len(b.master) + len(b.grads)


def test_search_fills_ram_first_and_spills_the_least_that_fits() -> None:
    m = PRESETS["shape:Llama-3.2-3B"]
    work = Workload(1024, 1, "fp32", spill_dir="/d", spill_free_bytes=60 * GiB)
    best = search.search(m, work, HW).require()
    level = _level(m, best.plan)
    assert 0 < level < spill_placement.fill_levels(m, True), best.plan.spill  # some of it on disk, not all
    # the search's plan is the fill's level, with a CPU device's choices (in place while no master or grad spills)
    assert best.plan == spill_placement.at_level(best.plan, m, level, HW.device_is_host).replace(
        workload=best.plan.workload)
    assert not search.overruns(best.memory, work, HW)
    # One block's kind less on disk and it no longer fits in RAM.
    fewer = spill_placement.at_level(best.plan, m, level - 1, HW.device_is_host)
    over = search.overruns(memory_model.estimate(m, work, fewer, HW), work, HW)
    assert [o.budget for o in over] == ["host RAM"]


def test_ram_and_disk_together_train_what_neither_shorthand_fits() -> None:
    """Llama-3.2-3B in fp32: m and v alone on disk leave 8 bytes/param (26 GB) in RAM, too much; everything on
    disk takes 16 bytes/param (51 GB), more than a 40 GB disk. Filling RAM first and the disk with the rest
    fits both."""
    m = PRESETS["shape:Llama-3.2-3B"]
    disk = 40 * 10**9
    work = Workload(1024, 1, "fp32", spill_dir="/d", spill_free_bytes=disk)
    for forced in ("optimizer", "all"):
        assert not search.search(m, dataclasses.replace(work, spill=forced), HW).feasible, forced
    best = search.search(m, work, HW).require()
    assert best.plan.spill == "blocks" and 0 < best.memory.nvme_bytes <= disk
    assert best.memory.device_bytes + best.memory.host_bytes <= HW.host_budget_bytes


def test_largest_llama_is_set_by_ram_and_disk_together() -> None:
    disk = 60 * GiB
    work = Workload(1024, 1, "fp32", spill_dir="/d", spill_free_bytes=disk)
    answer = sizing.largest_llama(work, HW)
    assert answer.model is not None and answer.choice is not None
    ram_only = sizing.largest_llama(dataclasses.replace(work, spill="none"), HW)
    assert ram_only.model is not None and answer.model.params > 3 * ram_only.model.params
    # One more layer at its width does not fit; what it has fills the disk (within one layer's state).
    width = next(w for w in sizing.LLAMA_WIDTHS if w[0] == answer.model.hidden_size)
    assert not search.fits(sizing.llama_shape(*width, answer.model.num_layers + 1), work, HW)
    per_layer_state = 16 * answer.model.numel_layer
    assert disk - per_layer_state * 2 <= answer.choice.memory.nvme_bytes <= disk
    data = answer.to_dict()
    assert data["params"] == answer.model.params and data["nvme_bytes"] == answer.choice.memory.nvme_bytes


@pytest.mark.parametrize("ram_gib", [4, 6, 9, 12, 15, 18, 22])
def test_fill_finds_the_least_level_that_fits(ram_gib) -> None:
    """Against a scan of every level: the fill's level is the least whose memory fits host RAM (staging makes
    RAM rise at the first level of each group, so a plain binary search over all levels could miss it)."""
    m = ONE_B
    hw = HW.replace(host_available_bytes=ram_gib * GiB, cgroup_limit_bytes=0)
    work = Workload(128, 1, "fp32", spill_dir="/d")
    base = Plan(spill="all", spill_dir="/d", loss_chunk_tokens=64)
    fits = [not search.overruns(memory_model.estimate(m, work, spill_placement.at_level(base, m, level, hw.device_is_host),
                                                      hw), work, hw)
            for level in range(spill_placement.fill_levels(m, True) + 1)]
    filled = candidate_fit.fill(m, work, base, hw, chunk=64)
    if not any(fits[1:]):
        assert filled == base
    else:
        assert _level(m, filled) == fits.index(True, 1), (ram_gib, fits)


@pytest.mark.parametrize("gpu_gib", [2, 80])
def test_fill_level_moves_no_device_byte_on_a_gpu(gpu_gib) -> None:
    """The fill stops at the first level that overruns the GPU: on a GPU the placement moves host state only, so
    every level needs the same device memory; with the GPU too small, the plan comes back unchanged, as a scan of
    every level finds none that fits."""
    m = ONE_B
    hw = HW.replace(gpu_name="gpu", gpu_mem_bytes=gpu_gib * GiB, host_available_bytes=22 * GiB, cgroup_limit_bytes=0)
    assert not hw.device_is_host
    work = Workload(4096, 8, "bfloat16", spill_dir="/d")
    base = Plan(spill="all", spill_dir="/d", micro_batch_size=8, loss_chunk_tokens=64)
    estimates = [memory_model.estimate(m, work, spill_placement.at_level(base, m, level), hw)
                 for level in range(spill_placement.fill_levels(m, True) + 1)]
    staged = [memory_model.estimate(m, work, base.replace(spill_staging=n, spill_chunk_bytes=c), hw)
              for n in (1, 8, 64) for c in (1 << 20, 1 << 26)]
    assert len({e.device_bytes for e in estimates + staged}) == 1  # so expert_groups prices it unspilled
    assert len({e.host_bytes for e in estimates}) > 1
    fits = [not search.overruns(e, work, hw) for e in estimates]
    filled = candidate_fit.fill(m, work, base, hw, chunk=64)
    if not any(fits[1:]):
        assert filled == base
    else:
        assert _level(m, filled) == fits.index(True, 1), (gpu_gib, fits)


def test_overview_names_the_largest_llama_for_ram_and_disk(capsys, monkeypatch, tmp_path) -> None:
    from megatrain.planner.commands import cli
    from test_planner_answers import FREE, _free_disk

    profile = tmp_path / "hw.json"
    CPU_24G.save(str(profile))
    _free_disk(monkeypatch, FREE)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--hardware", str(profile), "--seq-len", "1024", "--batch", "1", "--json"]) == 0
    big = json.loads(capsys.readouterr().out)["largest_llama"]
    answer = sizing.largest_llama(Workload(1024, 1, "fp32", spill_dir=str(tmp_path), spill_free_bytes=FREE), HW)
    assert big == answer.to_dict() and 0 < big["nvme_bytes"] <= FREE
    assert big["params"] > PRESETS["shape:Llama-3.2-3B"].params       # more than RAM alone or the shorthands allow
    assert answer.line().startswith(f"largest Llama-shaped model with this RAM and disk: {big['params'] / 1e9:.2f}B")
