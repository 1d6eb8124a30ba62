"""Spilled fp32 masters load on the loader thread ([Note: spilled loads]): off the compute thread, after their
update, equal to training with everything in RAM."""
from __future__ import annotations

import importlib.util
import threading
import time

import pytest
import torch

from megatrain.plan.buffer_kinds import BufferKind
from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan
from megatrain.runtime.pipeline import spilled_loads
from megatrain.runtime.spill.spill_files import SpillFiles

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2)


def _train(plan: Plan, steps: int = 3) -> tuple[dict[str, torch.Tensor], list[float]]:
    ids = torch.randint(0, CONFIG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    with Engine(CONFIG, OptimizerConfig(lr=1e-2, max_grad_norm=1.0), plan=plan, compute_dtype=torch.float32,
                device="cpu", seed=0) as engine:
        losses = [float(engine.step(ids, ids)) for _ in range(steps)]
        return {k: v.clone() for k, v in engine.state_dict().items()}, losses


@pytest.mark.parametrize("bounce", [False, True], ids=["into-slot", "bounce-buffers"])
def test_spilled_masters_load_as_in_ram(tmp_path, monkeypatch, bounce):
    """Both ways of reading a spilled master (straight into a CPU slot; through two bounce buffers and copies,
    CUDA's way, forced here) train bitwise as with the masters in RAM; the bounce path holds two chunks."""
    reference, ref_losses = _train(Plan())
    made: list[spilled_loads.SpilledLoads] = []
    init = spilled_loads.SpilledLoads.__init__

    def forced(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "bounce": bounce})
        made.append(self)

    monkeypatch.setattr(spilled_loads.SpilledLoads, "__init__", forced)
    # 4 KiB chunks: a layer's master is several chunks, so both bounce buffers take turns
    state, losses = _train(Plan(spill="all", spill_dir=str(tmp_path), spill_chunk_bytes=4096))
    assert losses == ref_losses
    for name, value in reference.items():
        assert torch.equal(state[name], value), name
    (loads,) = made
    assert len(loads._buffers) == (2 if bounce else 0)
    assert all(b.numel() == 1024 for b in loads._buffers)


def test_compute_never_reads_a_spilled_master_itself(tmp_path, monkeypatch):
    """Every read of a spilled master for a load is issued by the loader thread; the compute thread issues
    none while it steps (the AdamW worker reads masters for its updates)."""
    readers: list[str] = []
    read_async = SpillFiles.read_async

    def watched(self, kind, *args, **kwargs):
        if kind is BufferKind.MASTER:
            readers.append(threading.current_thread().name)
        return read_async(self, kind, *args, **kwargs)

    monkeypatch.setattr(SpillFiles, "read_async", watched)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with Engine(CONFIG, plan=Plan(spill="all", spill_dir=str(tmp_path)), compute_dtype=torch.float32,
                device="cpu") as engine:
        readers.clear()  # (initialisation wrote and read the masters on this thread)
        for _ in range(2):
            engine.step(ids, ids)
        engine.synchronize()
    assert "megatrain-loader" in readers
    assert threading.main_thread().name not in readers


def test_compute_of_a_block_does_not_wait_for_the_next_blocks_update(tmp_path, monkeypatch):
    """Deferred mode, spilled masters, prefetch depth 1: a step's forward computes block b as soon as b is
    updated and read, while AdamW still updates block b + 1 (each fused AdamW call, one per parameter, slowed by
    0.1 s here, a margin the loader thread meets even on a loaded machine). When the
    prefetch itself waited for the update of the load it issued, compute of b came after b + 1's update."""
    fused = torch._fused_adamw_

    def slow(*args, **kwargs):
        time.sleep(0.1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", slow)
    plan = Plan(num_slots=2, prefetch_depth=1, spill="all", spill_dir=str(tmp_path))
    ids = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with Engine(CONFIG, OptimizerConfig(max_grad_norm=1.0), plan=plan, compute_dtype=torch.float32,
                device="cpu") as engine:
        engine.event_log.enabled = True
        engine.step(ids, ids)
        engine.step(ids, ids)
        engine.synchronize()
        log = list(engine.event_log.entries)
    forward = [e for e in log if e.op == "compute" and e.step == 2 and e.phase == "fwd"]
    for now, after in zip(forward, forward[1:]):
        computed = log.index(now)
        next_updated = next(i for i, e in enumerate(log)
                            if e.op == "adam_end" and e.step == 1 and e.block == after.block)
        assert computed < next_updated, (now, after)


def test_a_load_takes_the_chunks_its_update_writes_instead_of_reading_them_back(tmp_path, monkeypatch):
    """The loader taps a block's master before waiting for its update: the chunks the update writes behind
    after that are copied into the slot as they are written and not read back. With updates slowed down (so
    every tap comes before its update of a layer), the second step's forward reads no layer's master from disk,
    where the first step (no update before it) read every one; training stays bitwise as in RAM."""
    fused = torch._fused_adamw_

    def slow(*args, **kwargs):
        time.sleep(0.1)
        return fused(*args, **kwargs)

    reference, ref_losses = _train(Plan(num_slots=2, prefetch_depth=1))
    monkeypatch.setattr(torch, "_fused_adamw_", slow)
    loader_reads: list[int] = []  # the block of each master chunk the loader thread reads
    read_async = SpillFiles.read_async

    def watched(self, kind, b, *args, **kwargs):
        if kind is BufferKind.MASTER and threading.current_thread().name == "megatrain-loader":
            loader_reads.append(b)
        return read_async(self, kind, b, *args, **kwargs)

    monkeypatch.setattr(SpillFiles, "read_async", watched)
    ids = torch.randint(0, CONFIG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    plan = Plan(num_slots=2, prefetch_depth=1, spill="all", spill_dir=str(tmp_path), spill_chunk_bytes=16384)
    with Engine(CONFIG, OptimizerConfig(lr=1e-2, max_grad_norm=1.0), plan=plan, compute_dtype=torch.float32,
                device="cpu", seed=0) as engine:
        layers = {load.block.index for load in engine.executor.schedule.layers}
        disk = engine.store.disk
        reads_per_step, lent_per_step, losses = [], [], []
        for _ in range(3):
            loader_reads.clear()
            copies = disk.lent_copies
            losses.append(float(engine.step(ids, ids)))  # (no synchronize: the update runs into the next step)
            reads_per_step.append(list(loader_reads))
            lent_per_step.append(disk.lent_copies - copies)
        state = {k: v.clone() for k, v in engine.state_dict().items()}
    assert losses == ref_losses
    for name, value in reference.items():
        assert torch.equal(state[name], value), name
    # step 1: every layer read twice (forward, and backward's recompute); later steps: backward's reads only, less
    # the chunks the AdamW worker read ahead for the next update, which the load copies ([Note: lent masters])
    assert all(reads_per_step[0].count(b) >= 2 for b in layers)
    first, later = ({b: step.count(b) for b in layers} for step in reads_per_step[:2])
    assert all(later[b] <= first[b] // 2 for b in layers), (first, later)
    assert sum(first[b] // 2 - later[b] for b in layers) == lent_per_step[1], (first, later, lent_per_step)


@pytest.mark.parametrize("bounce", [False, True], ids=["into-slot", "bounce-buffers"])
def test_loads_copy_the_masters_read_ahead_for_the_update_instead_of_reading_them(tmp_path, monkeypatch, bounce):
    """Eager updates, staging sets for every chunk: once the AdamW worker has read the next step's chunks ahead
    (given time between the steps here), that step's loads, forward and backward, copy every master chunk from
    the sets ([Note: lent masters]) and read none from disk; training stays bitwise as with the masters in RAM,
    straight into a CPU slot or through CUDA's bounce buffers (forced)."""
    def train(plan: Plan, pause: float) -> tuple[dict[str, torch.Tensor], list[float], list[int], list[int]]:
        ids = torch.randint(0, CONFIG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
        reads, copies, losses = [], [], []
        with Engine(CONFIG, OptimizerConfig(lr=1e-2, max_grad_norm=None), plan=plan, compute_dtype=torch.float32,
                    device="cpu", seed=0) as engine:
            disk = engine.store.disk
            for _ in range(3):
                engine.synchronize()
                time.sleep(pause)  # the worker reads the next step's chunks ahead meanwhile
                loader_reads.clear()
                before = disk.lent_copies if disk else 0
                losses.append(float(engine.step(ids, ids)))
                reads.append(len(loader_reads))
                copies.append((disk.lent_copies if disk else 0) - before)
            return {k: v.clone() for k, v in engine.state_dict().items()}, losses, reads, copies

    loader_reads: list[int] = []
    read_async = SpillFiles.read_async

    def watched(self, kind, b, *args, **kwargs):
        if kind is BufferKind.MASTER and threading.current_thread().name == "megatrain-loader":
            loader_reads.append(b)
        return read_async(self, kind, b, *args, **kwargs)

    init = spilled_loads.SpilledLoads.__init__
    monkeypatch.setattr(spilled_loads.SpilledLoads, "__init__",
                        lambda self, *args, **kwargs: init(self, *args, **{**kwargs, "bounce": bounce}))
    monkeypatch.setattr(SpillFiles, "read_async", watched)
    reference, ref_losses, _, _ = train(Plan(optimizer_mode="eager"), 0.0)
    plan = Plan(optimizer_mode="eager", spill="all", spill_dir=str(tmp_path), spill_chunk_bytes=4096, spill_staging=64)
    state, losses, reads, copies = train(plan, 0.5)
    assert losses == ref_losses
    for name, value in reference.items():
        assert torch.equal(state[name], value), name
    assert reads[0] > 0 and copies[0] == 0  # the first step: nothing read ahead yet
    assert reads[1:] == [0, 0] and copies[1] == copies[2] == reads[0], (reads, copies)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("io_backend", ["posix", "kvikio"])
def test_spilled_masters_load_on_cuda_as_in_ram(tmp_path, io_backend):
    """On CUDA the loader thread reads a spilled master through the pinned bounce buffers and copies it up on the
    h2d stream, recording the slot's event after the last copy: training equals the masters in RAM, bitwise, with
    either file backend (kvikio: the ``[gds]`` extra, GPUDirect Storage or its compatibility mode)."""
    if io_backend == "kvikio" and importlib.util.find_spec("kvikio") is None:
        pytest.skip("kvikio is not installed (pip install megatrain[gds])")
    ids = torch.randint(0, CONFIG.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for plan in (Plan(num_slots=2, prefetch_depth=1),
                 Plan(num_slots=2, prefetch_depth=1, spill="all", spill_dir=str(tmp_path), spill_chunk_bytes=4096,
                      io_backend=io_backend)):
        with Engine(CONFIG, OptimizerConfig(lr=1e-2, max_grad_norm=1.0), plan=plan, compute_dtype=torch.float32,
                    device="cuda", seed=0) as engine:
            losses = [float(engine.step(ids, ids)) for _ in range(3)]
            results.append((losses, {k: v.clone() for k, v in engine.state_dict().items()}))
    assert results[0][0] == results[1][0]
    for name, value in results[0][1].items():
        assert torch.equal(results[1][1][name], value), name
