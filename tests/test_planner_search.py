"""Plan search: a returned plan never exceeds a budget; an infeasible answer names one really exceeded."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatrain.plan import buffer_kinds, plan_checks
from megatrain.planner.costs import data_parallel, memory_model, resident_blocks, spill_placement
from megatrain.planner.profiling import hardware
from megatrain.planner.shapes import model_shapes
from megatrain.planner.choice import candidate_fit, plan_variants, search, spill_choices
from megatrain.planner.profiling.hardware import GiB, HardwareProfile
from megatrain.planner.shapes.model_shapes import PRESETS, ModelShape
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload, WorkloadError
from hypothesis_budget import examples


@st.composite
def profiles(draw: st.DrawFn) -> HardwareProfile:
    ram = draw(st.integers(4, 4096)) * GiB
    gpu = draw(st.sampled_from([0, 1, 4, 8, 16, 24, 40, 80, 141])) * GiB
    h2d = draw(st.floats(1.0, 500.0))
    return HardwareProfile(
        gpu_name="random", gpu_mem_bytes=gpu, h2d_gbps=h2d, d2h_gbps=draw(st.floats(1.0, 500.0)),
        duplex_gbps=draw(st.floats(1.0, 1000.0)), matmul_tflops={"bfloat16": draw(st.floats(0.05, 2000.0)),
                                                                "float32": draw(st.floats(0.05, 100.0))},
        cpu_adam_params_per_s=draw(st.floats(1e7, 2e10)), host_ram_bytes=ram,
        host_available_bytes=int(ram * draw(st.floats(0.1, 1.0))), cores=draw(st.integers(1, 256)),
        cgroup_limit_bytes=draw(st.sampled_from([0, 8 * GiB, 64 * GiB])),
        disk_read_gbps=draw(st.sampled_from([0.0, 0.5, 7.0])), disk_write_gbps=draw(st.sampled_from([0.5, 5.0])))


@st.composite
def models(draw: st.DrawFn) -> ModelShape:
    if draw(st.booleans()):
        return draw(st.sampled_from(list(PRESETS.values())))
    kv = draw(st.integers(1, 8))
    heads = kv * draw(st.integers(1, 8))
    head_dim = draw(st.sampled_from([16, 32, 64, 128]))
    return ModelShape(name="random", hidden_size=draw(st.integers(1, 64)) * 64,
                      intermediate_size=draw(st.integers(1, 256)) * 64, num_layers=draw(st.integers(1, 96)),
                      num_heads=heads, num_kv_heads=kv, head_dim=head_dim, vocab_size=draw(st.integers(100, 200000)),
                      tie_word_embeddings=draw(st.booleans()), attention_bias=draw(st.booleans()),
                      qk_norm=draw(st.booleans()))


workloads = st.builds(Workload, seq_len=st.sampled_from([128, 1000, 2048, 4096, 16384]),
                      batch=st.integers(1, 64), compute_dtype=st.sampled_from(["bf16", "fp32"]),
                      clipping=st.booleans(), spill_dir=st.sampled_from([None, "/nvme"]),
                      spill_free_bytes=st.sampled_from([None, 0, 64 * GiB, 1 << 40]))


def _grouped_candidates(model: ModelShape, work: Workload, hw: HardwareProfile) -> list[Plan]:
    """Every candidate in the expert groups the search gives it (a sparse model's layers may stream in parts)."""
    return [candidate_fit.expert_groups(model, work, plan, hw) for plan in search.candidates(model, work, hw)]


@settings(max_examples=examples(100))
@given(hw=profiles(), model=models(), work=workloads)
def test_plans_fit_and_refusals_are_true(hw: HardwareProfile, model: ModelShape, work: Workload) -> None:
    result = search.search(model, work, hw)
    if result.feasible:
        best = result.require()
        # Recompute memory independently of the search's own bookkeeping.
        mem = memory_model.estimate(model, work, best.plan, hw)
        assert mem.overruns(hw) == []
        assert work.spill_free_bytes is None or mem.nvme_bytes <= work.spill_free_bytes
        assert best.plan.spill == "none" or (best.plan.spill_dir == work.spill_dir is not None
                                             and hw.disk_read_gbps > 0)
        if hw.device_is_host:
            assert mem.device_bytes + mem.host_bytes <= hw.host_budget_bytes
        else:
            assert mem.device_bytes <= hw.gpu_mem_bytes
            assert mem.host_bytes <= hw.host_budget_bytes
        if work.clipping:
            assert best.plan.optimizer_mode == "deferred"
        assert best.cost is not None and best.cost.step_seconds > 0
        assert Plan.from_json(best.plan.to_json()) == best.plan
        return
    assert result.overruns, "an infeasible answer names a budget"
    budgets = {"gpu memory": hw.gpu_mem_bytes, "host RAM": hw.host_budget_bytes, "NVMe": work.spill_free_bytes}
    other = result.other_route[1] if result.other_route is not None else ()
    for o in result.overruns + other:
        assert o.available == budgets[o.budget]
        assert o.needed > o.available, o.message()
    if result.other_route is not None:  # the other route falls short of some budget the first one meets
        assert {o.budget for o in other} != {o.budget for o in result.overruns}
        assert result.other_route[0] in result.reason()
    # And it really is infeasible: no candidate (with its smallest loss chunk) fits.
    mems = [memory_model.estimate(model, work, plan.replace(loss_chunk_tokens=min(64, plan.loss_chunk_tokens)), hw)
            for plan in _grouped_candidates(model, work, hw)]
    for mem in mems:
        assert mem.overruns(hw) or (work.spill_free_bytes is not None and mem.nvme_bytes > work.spill_free_bytes)
    # A budget every plan exceeds is reported with the least any plan needs.
    for o in result.overruns:
        needs = [mem.nvme_bytes if o.budget == "NVMe"
                 else mem.device_bytes if o.budget == "gpu memory" and not hw.device_is_host
                 else mem.device_bytes + mem.host_bytes if hw.device_is_host else mem.host_bytes for mem in mems]
        assert o.needed >= min(needs)


def test_infeasible_names_the_budget() -> None:
    r = search.search(PRESETS["shape:Llama-3.1-405B"], Workload(4096, 8), hardware.preset("RTX-4090"))
    assert not r.feasible
    assert {o.budget for o in r.overruns} == {"gpu memory", "host RAM"}
    assert "short by" in r.reason()
    try:
        r.require()
    except search.InfeasibleError as e:
        assert "gpu memory" in str(e)
    else:
        raise AssertionError("require() must raise on an infeasible result")


def test_clipping_forces_deferred_and_no_clip_may_choose_eager() -> None:
    # 116 GiB of RAM: with 128, the embedding's state on the GPU (16 bytes a parameter there) lets 8B fit with clipping
    m, hw = PRESETS["shape:Llama-3.1-8B"], hardware.preset("RTX-4090").with_overrides(ram_bytes=116 * GiB)
    clip = search.search(m, Workload(4096, 4, clipping=True, spill="none"), hw)
    assert not clip.feasible                      # 18 B/param do not fit 116 GiB of RAM...
    eager = search.search(m, Workload(4096, 4, clipping=False, spill="none"), hw)
    assert eager.feasible                         # ...14 B/param plus slabs do
    assert eager.require().plan.optimizer_mode == "eager"
    # ...and with a spill directory, clipping fits
    spilled = search.search(m, Workload(4096, 4, clipping=True, spill_dir="/nvme"), hw).require()
    assert spilled.plan.spill != "none" and spilled.plan.optimizer_mode == "deferred"
    assert spilled.plan.spill_dir == "/nvme"
    assert sum(c.nbytes for c in spilled.memory.components if c.where == "nvme") > 0


def test_spill_needs_a_directory_and_disk_figures() -> None:
    m, hw = PRESETS["shape:Llama-3.1-8B"], hardware.preset("RTX-4090").with_overrides(ram_bytes=116 * GiB)
    # auto without a directory: the search never invents one, so nothing spills and 8B does not fit.
    r = search.search(m, Workload(4096, 4), hw)
    assert not r.feasible and all(p.spill == "none" for p in search.candidates(m, Workload(4096, 4), hw))
    with pytest.raises(WorkloadError, match="--spill-dir"):
        Workload(4096, 4, spill="all")
    no_disk = hw.replace(disk_read_gbps=0.0, disk_write_gbps=0.0)
    with pytest.raises(search.InfeasibleError, match="--nvme"):
        search.search(m, Workload(4096, 4, spill="optimizer", spill_dir="/nvme"), no_disk)
    # auto with a directory but no disk figures: no spill plan (nothing to time it with).
    assert not search.search(m, Workload(4096, 4, spill_dir="/nvme"), no_disk).feasible
    # forced spill is honoured
    forced = search.search(m, Workload(4096, 4, spill="all", spill_dir="/nvme"), hw).require()
    assert forced.plan.spill == "all" and forced.plan.spill_dir == "/nvme"


def test_spill_respects_free_disk_space() -> None:
    m, hw = PRESETS["shape:Llama-3.1-8B"], hardware.preset("RTX-4090").with_overrides(ram_bytes=116 * GiB)
    roomy = search.search(m, Workload(4096, 4, spill_dir="/nvme", spill_free_bytes=1 << 40), hw).require()
    nvme = roomy.memory.nvme_bytes
    assert nvme > 0
    tight = search.search(m, Workload(4096, 4, spill_dir="/nvme", spill_free_bytes=nvme - 1), hw)
    if tight.feasible:   # a smaller spill (optimizer only) may still fit
        assert tight.require().memory.nvme_bytes <= nvme - 1
    full = search.search(m, Workload(4096, 4, spill_dir="/nvme", spill_free_bytes=0), hw)
    assert not full.feasible and "host RAM" in full.reason()


def test_search_records_the_workload() -> None:
    m, hw = PRESETS["shape:Llama-3.2-1B"], hardware.preset("H100-SXM")
    plan = search.search(m, Workload(2048, 8, "fp32"), hw).require().plan
    w = plan.workload
    assert w is not None and (w.seq_len, w.batch, w.compute_dtype, w.params) == (2048, 8, "float32", m.params)
    assert w.model == "shape:Llama-3.2-1B" and Plan.from_json(plan.to_json()) == plan


def test_preferred_compute_dtype_follows_the_profile() -> None:
    assert hardware.preferred_compute_dtype(hardware.preset("H100-SXM")) == "bfloat16"
    cpu = hardware.preset("H100-SXM").replace(gpu_mem_bytes=0, matmul_tflops={"float32": 0.06, "bfloat16": 0.0005})
    assert hardware.preferred_compute_dtype(cpu) == "float32"


def test_plan_is_valid_and_bounds_follow_each_other() -> None:
    r = search.search(PRESETS["shape:Qwen2.5-7B"], Workload(1024, 158), hardware.preset("H100-SXM")).require()
    p = r.plan
    assert p.num_slots == p.prefetch_depth + 1
    assert p.loss_chunk_tokens <= p.micro_batch_size * 1024
    assert r.memory.device_bytes <= hardware.preset("H100-SXM").gpu_mem_bytes


def test_micro_batch_sizes_cover_counts() -> None:
    sizes = search.micro_batch_sizes(158)
    assert sizes[0] == 1 and sizes[-1] == 158
    assert {64, 128, 79, 53, 40} <= set(sizes)


def test_longest_context_and_minimum_memory() -> None:
    m, hw = PRESETS["shape:Llama-3.2-1B"], hardware.preset("H100-SXM")
    ctx = search.longest_context(m, hw)
    assert ctx % 1024 == 0 and ctx > 65536
    assert search.fits(m, Workload(ctx, 1), hw) and not search.fits(m, Workload(ctx + 1024, 1), hw)
    least = search.minimum_memory(m, Workload(4096, 8), hw)
    assert least["gpu"].memory.device_bytes <= least["host"].memory.device_bytes
    assert least["host"].memory.host_bytes <= least["gpu"].memory.host_bytes


def test_spill_chunks_are_a_layer_and_staging_sets_never_exceed_the_chunks_of_one_update_pass() -> None:
    """A 34M model (8 layers of 3.1M elements, a tied 8.4M-element embedding): its spill chunks are a layer's
    bytes, so the embedding is cut into 3 chunks and a staging set holds a layer's worth (Ck, the memory model's
    charge per set and kind); an update pass is 8 + 3 + 1 (the head's norm) = 12 chunks, so the search offers
    at most 12 staging sets and, with RAM to spare, takes 12 (as fast as any deeper read-ahead, less memory)."""
    m = model_shapes.from_config(dict(model_type="llama", vocab_size=16384, hidden_size=512, intermediate_size=1536,
                                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                      tie_word_embeddings=True))
    chunk = spill_choices.spill_chunk_bytes(m)
    assert chunk == -(-m.numel_layer * 4 // 4096) * 4096 < Plan.spill_chunk_bytes
    assert -(-m.numel_embedding * 4 // chunk) == 3
    assert spill_choices.spill_staging_choices(m, chunk) == (1, 3, 8, 12)
    assert spill_choices.spill_staging_choices(m, Plan.spill_chunk_bytes) == (1, 3, 8, 10)  # one chunk a block
    hw = HardwareProfile(gpu_name="cpu", gpu_mem_bytes=0, h2d_gbps=5.0, d2h_gbps=5.0, duplex_gbps=5.0,
                         matmul_tflops={"float32": 0.2}, cpu_adam_params_per_s=1e9, host_ram_bytes=64 * GiB,
                         host_available_bytes=60 * GiB, cores=2, disk_read_gbps=1.0, disk_write_gbps=1.0)
    best = search.search(m, Workload(256, 4, "fp32", spill="all", spill_dir="/nvme"), hw).require()
    assert (best.plan.spill_staging, best.plan.spill_chunk_bytes) == (12, chunk)
    staging = next(c for c in best.memory.components if c.name == "spill staging")
    assert staging.nbytes == 12 * 4 * chunk  # P x k x Ck x 4: a layer's bytes per set and kind
    big = PRESETS["shape:Llama-3.2-3B"]  # 28 layers of 0.8 GB: 64 MiB chunks, many of them
    assert spill_choices.spill_chunk_bytes(big) == Plan.spill_chunk_bytes
    assert spill_choices.spill_staging_choices(big, Plan.spill_chunk_bytes) == spill_choices.SPILL_STAGING


def test_a_cpu_device_computes_in_place_with_adamw_on_the_compute_thread_where_it_can() -> None:
    """One process on a CPU device, nothing spilled: compute in place and AdamW on the compute thread; a GPU, or
    data-parallel ranks: copies and the worker; spilling everything: the worker (it waits for the disk), copies
    (no master in RAM); the fill's levels compute in place while only m and v spill, and not beyond them."""
    m = model_shapes.from_config(dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=512,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))
    cpu = HardwareProfile(gpu_name="cpu", gpu_mem_bytes=0, h2d_gbps=5.0, d2h_gbps=5.0, duplex_gbps=5.0,
                          matmul_tflops={"float32": 0.2}, cpu_adam_params_per_s=1e9, host_ram_bytes=64 * GiB,
                          host_available_bytes=60 * GiB, cores=2, disk_read_gbps=1.0, disk_write_gbps=1.0)
    work = Workload(256, 4, "fp32")
    choices = lambda p: (p.adam_thread, p.compute_in_place)  # noqa: E731
    assert choices(search.search(m, work, cpu).require().plan) == ("compute", True)
    gpu = hardware.preset("H100-SXM")
    assert choices(search.search(m, work, gpu).require().plan) == ("worker", False)
    ranks = data_parallel.topology(cpu, 2, 1)
    assert choices(search.search(m, work, cpu, ranks=ranks).require().plan) == ("worker", False)
    spilled = search.search(m, Workload(256, 4, "fp32", spill="all", spill_dir="/nvme"), cpu).require().plan
    assert choices(spilled) == ("worker", False)
    # Spilling what RAM cannot hold ("auto"): with less and less RAM the fill spills m and v, then masters and
    # gradients; it computes in place exactly while every master and gradient is in RAM.
    big = PRESETS["shape:Llama-3.2-1B"]  # its state, not the process, is most of its RAM
    auto = Workload(256, 1, "fp32", spill="auto", spill_dir="/nvme", spill_free_bytes=64 * GiB)
    full = search.search(big, Workload(256, 1, "fp32"), cpu).require().memory.host_bytes
    seen = set()
    for share in (0.95, 0.85, 0.75, 0.65, 0.55, 0.45, 0.35, 0.25):
        result = search.search(big, auto, cpu.replace(host_available_bytes=int(full * share)))
        if not result.feasible:
            continue
        p = result.require().plan
        blocks = p.spill_blocks
        spilled = p.spill == "all" or (p.spill == "blocks" and blocks is not None and bool(blocks.master or blocks.grads))
        assert choices(p) == ("compute" if p.spill == "none" else "worker", not spilled), (share, p.spill, blocks)
        seen.add((p.spill != "none", spilled))
    assert {(True, False), (True, True)} <= seen, seen  # m and v only, and masters or gradients too


def test_near_ties_go_to_less_gpu_memory_then_ram_and_on_a_cpu_device_to_less_ram_in_all() -> None:
    """Of plans equally fast: with a GPU the least device memory wins, then the least host RAM; where the device is
    the CPU its buffers are RAM as well, so the least of the two together wins (a spilled 3.2B had taken 7.5 GiB
    more staging sets for 0.56 GiB fewer "device" bytes)."""
    def choice(device_gib: float, host_gib: float) -> search.PlanChoice:
        parts = (memory_model.Component("weight slots", "device", int(device_gib * GiB), "d"),
                 memory_model.Component("spill staging", "host", int(host_gib * GiB), "h"))
        return search.PlanChoice(Plan(), memory_model.MemoryEstimate(parts), None)

    deeper, kept = choice(6.10, 15.30), choice(6.66, 7.78)
    assert search.least_memory([deeper, kept], device_is_host=False) is deeper
    assert search.least_memory([deeper, kept], device_is_host=True) is kept
    assert search.least_memory([kept, deeper], device_is_host=True) is kept


def test_near_ties_keep_everything_in_ram_where_a_plan_can() -> None:
    """Qwen2.5-7B, 16 x 4096 tokens on an H100 with 256 GiB of RAM and a spill folder: plans that spill a few GiB
    time within the tolerance of those that spill nothing, and the tie goes to nothing on disk before less GPU
    memory (it had gone to 4.1 GiB spilled for 0.0 ms)."""
    hw = hardware.preset("H100-SXM").with_overrides(ram_bytes=256 * GiB)
    model = model_shapes.resolve("shape:Qwen2.5-7B")
    work = Workload(4096, 16, spill_dir="/tmp")
    fit, _ = search.feasible_choices(model, work, hw)
    fastest = min(c.cost.step_seconds for c in fit)
    close = [c for c in fit if c.cost.step_seconds <= fastest * (1 + search.TIME_TOLERANCE)]
    assert any(c.memory.nvme_bytes for c in close) and any(not c.memory.nvme_bytes for c in close)
    best = search.search(model, work, hw).best
    assert best is not None and best.memory.nvme_bytes == 0 and best.plan.spill == "none"


def test_most_staging_is_the_most_sets_that_fit_up_to_one_update_pass() -> None:
    """``spill_choices.most_staging``: the largest count ``fits`` allows (memory grows with the sets), never more
    than the chunks of one update pass over every block, never fewer than the plan has."""
    m = PRESETS["shape:Llama-3.2-3B"]
    plan = Plan(spill="all", spill_dir="/nvme", spill_staging=3)
    cap = spill_choices.update_pass_chunks(m, plan.spill_chunk_bytes)
    assert cap == sum(-(-n * 4 // plan.spill_chunk_bytes) for n in spill_placement.block_numels(m)) > 64
    assert spill_choices.most_staging(m, plan, lambda n: n <= 37) == 37
    assert spill_choices.most_staging(m, plan, lambda n: True) == cap
    assert spill_choices.most_staging(m, plan, lambda n: n <= 3) == 3
    # some blocks on disk: a set stages a chunk of those only, so no more sets than their chunks
    some = Plan(spill="blocks", spill_dir="/nvme", spill_staging=3, spill_blocks={"master": [1, 3], "grads": [2]})
    numels = spill_placement.block_numels(m)
    staged = sum(len(buffer_kinds.spill_chunks(numels[b], some.spill_chunk_bytes)) for b in (1, 2, 3))
    assert 3 < staged < cap and spill_choices.most_staging(m, some, lambda n: True) == staged


def test_a_spilled_plan_takes_the_most_staging_sets_its_ram_allows() -> None:
    """Of equally fast plans the search takes the least memory; a spilled one then takes the most staging sets
    that fit, where the cost model times them no slower: the read-ahead's depth is worth more than the model
    prices it (64 sets against 24 on the 3.2B shape: about 10% faster, priced within 1%). With RAM for all of an
    update pass's chunks it takes them all; with RAM for between 24 and 64 sets, as many as fit, not a value of
    the search's grid (SPILL_STAGING)."""
    m = PRESETS["shape:Llama-3.2-3B"]
    cpu = HardwareProfile(gpu_name="cpu", gpu_mem_bytes=0, h2d_gbps=5.0, d2h_gbps=5.0, duplex_gbps=5.0,
                          matmul_tflops={"float32": 0.2}, cpu_adam_params_per_s=1e9, host_ram_bytes=256 * GiB,
                          host_available_bytes=250 * GiB, cores=2, disk_read_gbps=2.0, disk_write_gbps=4.0)
    work = Workload(128, 1, "fp32", clipping=False, spill="all", spill_dir="/nvme")
    roomy = search.search(m, work, cpu).require().plan
    assert roomy.spill_staging == spill_choices.update_pass_chunks(m, roomy.spill_chunk_bytes)

    def ram(plan: Plan, sets: int) -> int:
        mem = memory_model.estimate(m, work, plan.replace(spill_staging=sets), cpu)
        return mem.device_bytes + mem.host_bytes

    per_set = ram(roomy, 41) - ram(roomy, 40)
    tight = cpu.replace(cgroup_limit_bytes=int((ram(roomy, 40) + per_set // 2) / (1 - hardware.HOST_HEADROOM)))
    plan = search.search(m, work, tight).require().plan
    fits = lambda n: not memory_model.estimate(  # noqa: E731
        m, work, plan.replace(spill_staging=n), tight).overruns(tight)
    assert fits(plan.spill_staging) and not fits(plan.spill_staging + 1)
    assert 24 < plan.spill_staging < 64 and plan.spill_staging not in spill_choices.SPILL_STAGING


# The H200 machine of the GPU sessions as measured: 139.8 GiB of GPU memory, 118.08 GiB of host RAM usable.
H200_MEASURED = str(Path(__file__).resolve().parent.parent / "benchmarks/results/2026-11-28_H200_hardware.json")


def _short_of_ram(model: ModelShape, work: Workload, plan: Plan, hw: HardwareProfile) -> bool:
    return any(o.budget == "host RAM" for o in memory_model.estimate(model, work, plan, hw).overruns(hw))


QWEN3_MOE_12 = model_shapes.from_config(dict(PRESETS["shape:Qwen3-30B-A3B"].config, num_hidden_layers=12))


@pytest.mark.parametrize("model", [PRESETS["shape:Llama-3.1-8B"],  # 16 x 4096: 121.66 GiB of RAM with none
                                   QWEN3_MOE_12])                     # 12 of 48 layers, 8.1B, 8 x 4096: 122.70
def test_where_host_ram_binds_the_plan_keeps_the_fewest_blocks_state_on_the_gpu_that_lets_it_fit(
        model: ModelShape) -> None:
    """Clipping on, on the measured H200 machine: with every block's fp32 state in host RAM no plan fits (every
    candidate overruns host RAM, the GPU having room), and the search had answered "no plan"; the state of the
    first blocks on the GPU frees RAM 18 bytes a parameter, so a plan fits, and the search finds it, as does
    ``fits``. Each candidate takes the fewest first blocks resident that host RAM needs (``host_relief``)."""
    hw = HardwareProfile.load(H200_MEASURED)
    work = Workload(4096, 8 if model is QWEN3_MOE_12 else 16)
    plans = [candidate_fit.fill(model, work, candidate_fit.expert_groups(model, work, p, hw), hw) for p in
             search.candidates(model, work, hw)]
    assert all(_short_of_ram(model, work, p.replace(loss_chunk_tokens=64), hw) for p in plans)
    best = search.search(model, work, hw).require()
    r = len(best.plan.resident_blocks)
    assert r and best.plan.resident_blocks == resident_blocks.first_blocks(model, r)
    assert memory_model.estimate(model, work, best.plan, hw).overruns(hw) == []  # recomputed, not the search's
    assert _short_of_ram(model, work, best.plan.replace(resident_blocks=()), hw)
    assert search.fits(model, work, hw)
    over = candidate_fit.over(model, work, hw, None)
    for p in plans[:4]:  # the fewest: one block fewer is short of RAM
        fewest = plan_variants.host_relief(model, work, p, over, True)
        if fewest.resident_blocks:
            n = len(fewest.resident_blocks)
            assert not over(fewest) and _short_of_ram(model, work, fewest.replace(
                resident_blocks=resident_blocks.first_blocks(model, n - 1), loss_chunk_tokens=64), hw)


def test_host_relief_takes_the_fewest_first_blocks_that_ram_needs_and_only_a_plan_that_then_fits() -> None:
    """Against a hand-made budget: RAM needs ``need`` blocks resident, the GPU holds at most ``most``."""
    m, work = PRESETS["shape:Llama-3.2-1B"], Workload(2048, 8)  # 18 blocks

    def budget(need: int, most: int):
        def over(p: Plan) -> list[memory_model.Overrun]:
            r = len(p.resident_blocks)
            return ([memory_model.Overrun("host RAM", 10 + need - r, 10)] if r < need else []) + \
                ([memory_model.Overrun("gpu memory", 10 + r, 10)] if r > most else [])
        return over

    for need in range(1, 19):
        assert plan_variants.host_relief(m, work, Plan(), budget(need, 18), True).resident_blocks == tuple(range(need))
    assert plan_variants.host_relief(m, work, Plan(), budget(0, 18), True) == Plan()   # RAM does not bind
    assert plan_variants.host_relief(m, work, Plan(), budget(5, 4), True) == Plan()    # the GPU cannot take them
    assert plan_variants.host_relief(m, work, Plan(), budget(19, 18), True) == Plan()  # not even every block
    assert plan_variants.host_relief(m, work, Plan(), budget(5, 18), False) == Plan()  # a CPU device, or ranks
    bf16 = Workload(2048, 8, optimizer_state="bf16")  # the device AdamW keeps fp32 state only
    assert plan_variants.host_relief(m, bf16, Plan(), budget(5, 18), True) == Plan()


def test_spill_auto_finds_every_plan_an_explicit_spill_finds() -> None:
    """Qwen2.5-14B's shape, 8 x 4096, bf16 AdamW state, on the measured H200 machine with a 64 GiB disk:
    "optimizer" fits (m and v on disk, 55.02 GiB; masters in RAM, the weights cast from them on the device: no
    bf16 shadow in RAM, host 118.05 GiB). Auto had filled only candidates whose weights are rounded on the host,
    whose shadow pushed masters to disk as well (77.41 GiB, more than the disk): no plan. Its candidate spilling
    everything now has a twin cast on the device, filled within m and v."""
    hw = HardwareProfile.load(H200_MEASURED).with_overrides(nvme_gbps=3.0)
    m = PRESETS["shape:Qwen2.5-14B"]

    def best(spill: str) -> search.SearchResult:
        return search.search(m, Workload(4096, 8, spill=spill, spill_dir="/nvme", spill_free_bytes=64 * GiB,
                                         optimizer_state="bf16"), hw)

    optimizer, auto = best("optimizer").require(), best("auto").require()
    assert optimizer.plan.weights_cast == "device" and optimizer.memory.nvme_bytes <= 64 * GiB
    assert auto.memory.nvme_bytes <= 64 * GiB and not plan_checks.master_spills(auto.plan)
    assert auto.cost.step_seconds <= optimizer.cost.step_seconds * (1 + search.TIME_TOLERANCE)
    assert not best("all").feasible and not best("none").feasible


@settings(max_examples=examples(12), deadline=None)
@given(ram=st.integers(8, 20), state=st.sampled_from(["fp32", "bf16"]), clipping=st.booleans(),
       free=st.sampled_from([6, 10, 1024]))
@example(ram=12, state="fp32", clipping=True, free=10)   # auto had found no plan where "optimizer" took 6.74 s
@example(ram=13, state="bf16", clipping=True, free=1024)  # auto had taken 4.40 s where "optimizer" took 3.44 s
def test_spill_auto_is_never_beaten_by_an_explicit_spill(ram: int, state: str, clipping: bool, free: int) -> None:
    """Whatever "none", "optimizer" or "all" finds, "auto" finds too, at most the search's tolerance slower: the
    1.24B shape, 2 x 512, with RAM about its fp32 masters and gradients (the weights cast on the device, no shadow
    in RAM, where m and v spill) and a disk that holds m and v or more."""
    model, hw = PRESETS["shape:Llama-3.2-1B"], hardware.preset("H100-SXM").with_overrides(ram_bytes=ram * GiB,
                                                                                          nvme_gbps=3.0)

    def step(spill: str) -> float | None:
        r = search.search(model, Workload(512, 2, clipping=clipping, spill=spill, spill_dir="/nvme",
                                          spill_free_bytes=free * GiB, optimizer_state=state), hw)
        return r.best.cost.step_seconds if r.best is not None and r.best.cost is not None else None

    auto = step("auto")
    for spill in ("none", "optimizer", "all"):
        explicit = step(spill)
        assert explicit is None or (auto is not None and auto <= explicit * (1 + search.TIME_TOLERANCE)), spill
