"""Host activation checkpoints in pieces on their own stream: the same numbers as whole copies and as
device checkpoints (fp32, bitwise), the order of the copies from the event log, and the planner's piece size."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from megatrain.planner.shapes import model_shapes
from megatrain.planner.choice import search
from megatrain.plan.plan import Plan, PlanError
from megatrain.planner.shapes.workload import Workload
from megatrain.runtime import Engine, ModelConfig, OptimizerConfig
from megatrain.runtime.pipeline.activation_checkpoints import pieces

CONFIG = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2)


def _train(plan: Plan, batch: int, seq: int, steps: int = 2, log: bool = False):
    torch.manual_seed(0)
    engine = Engine(CONFIG, OptimizerConfig(lr=1e-2, max_grad_norm=1.0), plan=plan, compute_dtype=torch.float32,
                    device="cpu")
    engine.event_log.enabled = log
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, CONFIG.vocab_size, (batch, seq), generator=gen)
        losses.append(engine.step(ids, ids).item())
    engine.synchronize()
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    entries = list(engine.event_log.entries)
    engine.close()
    return losses, state, entries


def test_pieces_cover_the_tokens_in_order() -> None:
    assert pieces(10, None) == [(0, 10)]
    assert pieces(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert pieces(10, 5) == [(0, 5), (5, 5)]
    assert pieces(3, 7) == [(0, 3)]


def test_piece_tokens_is_validated_and_in_the_plan_json() -> None:
    with pytest.raises(PlanError, match="checkpoint_piece_tokens=0"):
        Plan(checkpoints="host", checkpoint_piece_tokens=0)
    plan = Plan(checkpoints="host", checkpoint_piece_tokens=96)
    assert Plan.from_json(plan.to_json()) == plan and '"checkpoint_piece_tokens": 96' in plan.to_json()


@settings(max_examples=6, deadline=None)
@given(batch=st.integers(1, 3), seq=st.integers(2, 9), micro=st.integers(1, 3), piece=st.integers(1, 30))
@example(batch=3, seq=8, micro=2, piece=5)     # pieces that cut a micro-batch's rows unevenly
@example(batch=2, seq=6, micro=1, piece=3)     # pieces that divide the micro-batch's tokens
def test_pieces_train_like_whole_copies_and_device_checkpoints(batch: int, seq: int, micro: int, piece: int) -> None:
    device = _train(Plan(micro_batch_size=micro), batch, seq)
    whole = _train(Plan(micro_batch_size=micro, checkpoints="host"), batch, seq)
    cut = _train(Plan(micro_batch_size=micro, checkpoints="host", checkpoint_piece_tokens=piece), batch, seq)
    for other in (whole, cut):
        assert other[0] == device[0]
        assert all(torch.equal(other[1][k], device[1][k]) for k in device[1])


def test_copies_in_order_from_the_event_log() -> None:
    batch, seq, micro, piece = 3, 8, 2, 5        # micro-batches of 16 and 8 tokens: 4 and 2 pieces
    _, _, log = _train(Plan(micro_batch_size=micro, checkpoints="host", checkpoint_piece_tokens=piece), batch, seq,
                       log=True)
    layers = CONFIG.num_hidden_layers
    n_pieces = {0: math.ceil(16 / piece), 1: math.ceil(8 / piece)}
    at = {id(e): i for i, e in enumerate(log)}
    for step in (1, 2):
        ops = [e for e in log if e.step == step and e.op.startswith("ckpt_")]
        for layer in range(layers):
            block = layer + 1
            fwd = next(i for i, e in enumerate(log) if e.op == "compute" and e.step == step and e.block == block
                       and e.phase == "fwd")
            for m in (0, 1):
                drains = [e for e in ops if e.op == "ckpt_drain" and e.block == block and e.micro == m]
                reloads = [e for e in ops if e.op == "ckpt_reload" and e.block == block and e.micro == m]
                use = [e for e in ops if e.op == "ckpt_use" and e.block == block and e.micro == m]
                assert [e.piece for e in drains] == [e.piece for e in reloads] == list(range(n_pieces[m]))
                assert len(use) == 1 and all(e.slot == use[0].slot for e in reloads)
                assert all(at[id(d)] > fwd for d in drains)  # drained once the block's forward computes
                for d, r in zip(drains, reloads):
                    assert at[id(d)] < at[id(r)] < at[id(use[0])]  # piece i back after its own drain, before use
        # Backward's order of use: layers in reverse, micro-batches in order, alternating the two buffers.
        uses = [e for e in ops if e.op == "ckpt_use"]
        assert [(e.block, e.micro) for e in uses] == [(b, m) for b in range(layers, 0, -1) for m in (0, 1)]
        assert [e.slot for e in uses] == [k % 2 for k in range(len(uses))]
        # A buffer is filled again only after the use before it in backward order (its reader is issued).
        for k in range(2, len(uses)):
            item = (uses[k].block, uses[k].micro)
            first = next(e for e in ops if e.op == "ckpt_reload" and (e.block, e.micro) == item)
            assert at[id(uses[k - 1])] < at[id(first)]
        # The first two reloads go out when forward ends, before the head computes.
        head = next(i for i, e in enumerate(log) if e.op == "compute" and e.step == step and e.block == layers + 1)
        last_drain = max(at[id(e)] for e in ops if e.op == "ckpt_drain")
        early = [at[id(e)] for e in ops if e.op == "ckpt_reload" and (e.block, e.micro) in ((layers, 0), (layers, 1))]
        assert all(last_drain < i < head for i in early)


def test_planner_cuts_long_context_checkpoints_into_128_mib_pieces() -> None:
    """Llama-3.1-8B (h 4096) in bf16, one sequence of 128k tokens per micro-batch: its input is
    131072 x 4096 x 2 = 1 GiB > 256 MiB, so pieces of 128 MiB / (4096 x 2) = 16384 tokens; at 8k tokens (64 MiB),
    one copy."""
    shape = model_shapes.resolve("shape:Llama-3.1-8B")
    long = Workload(seq_len=131072, batch=1, compute_dtype="bf16", clipping=True)
    assert search.checkpoint_piece_tokens(shape, long, 1) == 128 * 2**20 // (4096 * 2) == 16384
    short = Workload(seq_len=8192, batch=8, compute_dtype="bf16", clipping=True)
    assert search.checkpoint_piece_tokens(shape, short, 1) is None
    assert search.checkpoint_piece_tokens(shape, short, 4) is None       # 4 x 8192 x 4096 x 2 = 256 MiB: one copy
    assert search.checkpoint_piece_tokens(shape, short, 8) == 16384      # 512 MiB: 128 MiB pieces
    plans = search.candidates(shape, long)
    assert {p.checkpoint_piece_tokens for p in plans if p.checkpoints == "host"} == {16384}
    assert {p.checkpoint_piece_tokens for p in plans if p.checkpoints == "device"} == {None}
