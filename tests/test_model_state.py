"""The model state's seams: edit_block (RAM or spilled master), grad_sink, and one rule for which buffer kinds spill.

See runtime/state/model_state.py and runtime/state/host_store.py.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from megatrain.planner.costs import memory_model
from megatrain.plan.buffer_kinds import BufferKind
from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan
from megatrain.runtime.device.streams import Event

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2)


def engine(tmp_path, spill: str = "none", mode: str = "deferred", dtype=torch.bfloat16) -> Engine:
    plan = Plan(optimizer_mode=mode, spill=spill, spill_dir=str(tmp_path) if spill != "none" else None,
                io_backend="posix")
    opt = OptimizerConfig(lr=1e-3, max_grad_norm=None if mode == "eager" else 1.0)
    return Engine(CONFIG, opt, plan=plan, compute_dtype=dtype, device="cpu", seed=5)


@pytest.mark.parametrize("spill", ["none", "all"])
def test_edit_block_stores_the_master_and_its_shadow(tmp_path, spill) -> None:
    with engine(tmp_path, spill) as e:
        state, b = e.state, 1
        before = state.read_block(BufferKind.MASTER, b).clone()
        with state.edit_block(b) as master:
            master.mul_(-2.0).add_(0.5)
        want = before * -2.0 + 0.5
        assert torch.equal(state.read_block(BufferKind.MASTER, b), want)  # spilled: read back from the file
        assert torch.equal(e.store.load_source(b), want.to(torch.bfloat16))
        others = state.read_block(BufferKind.MASTER, 0)
        assert not torch.equal(others, others * -2.0 + 0.5)  # only block b changed


def test_a_failed_edit_of_a_spilled_block_stores_nothing(tmp_path) -> None:
    with engine(tmp_path, "all") as e:
        before = e.state.read_block(BufferKind.MASTER, 0).clone()
        shadow = e.store.load_source(0).clone()
        with pytest.raises(KeyError):
            with e.state.edit_block(0) as master:
                master.zero_()
                raise KeyError("stop")
        assert torch.equal(e.state.read_block(BufferKind.MASTER, 0), before)
        assert torch.equal(e.store.load_source(0), shadow)


def test_spilled_and_ram_states_initialise_alike(tmp_path) -> None:
    with engine(tmp_path) as ram, engine(tmp_path, "all") as spilled:
        a, b = ram.state_dict(), spilled.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("spill,mode", list(itertools.product(["none", "optimizer", "all"], ["eager", "deferred"])))
def test_store_spills_what_the_memory_model_sizes(tmp_path, spill, mode) -> None:
    with engine(tmp_path, spill, mode, torch.float32) as e:
        assert e.store.spilled == memory_model.spilled_kinds(e.plan)
        for kind in BufferKind:
            in_ram = e.store.arena(kind) is not None
            kept = kind is not BufferKind.GRADS or mode == "deferred"
            assert in_ram == (kept and kind not in e.store.spilled), kind


def test_grad_sink_deferred_lands_in_the_grads_arena(tmp_path) -> None:
    with engine(tmp_path) as e:
        sink = e.store.grad_sink(1)
        sink.host.fill_(3.0)
        sink.on_drained(Event(False))
        assert sink.for_adam is sink.host and sink.release is None
        assert torch.equal(e.store.read_block(BufferKind.GRADS, 1), torch.full((e.store.numels[1],), 3.0))


def test_grad_sink_eager_slabs_are_bounded_and_released(tmp_path) -> None:
    with engine(tmp_path, mode="eager") as e:
        count = e.plan.host_grad_slabs
        sinks = [e.store.grad_sink(b % 3) for b in range(count)]
        assert len({s.host.data_ptr() for s in sinks}) == count

        def stop() -> None:
            raise TimeoutError("no slab")
        with pytest.raises(TimeoutError):  # every slab taken: the wait checks in, here giving up
            e.store.grad_sink(0, check=stop)
        sinks[0].release()
        assert e.store.grad_sink(0, check=stop).host.data_ptr() == sinks[0].host.data_ptr()


def test_grad_sink_with_spilled_grads_writes_the_file_behind_the_drain(tmp_path) -> None:
    with engine(tmp_path, "all") as e:
        data = torch.randn(e.store.numels[2])
        sink = e.store.grad_sink(2)
        sink.host.copy_(data)
        sink.on_drained(Event(False))
        assert sink.for_adam is None  # AdamW reads the block back from the file
        assert torch.equal(e.store.read_block(BufferKind.GRADS, 2), data)  # the read waits for the write
