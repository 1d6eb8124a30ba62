"""The spilled step on a CPU (planner/costs/spill_timing.py): the disk beside the CPU in each half of the step, the
read-ahead the staging sets and the backward's idle disk allow, checked by hand; the cost model uses it."""
from __future__ import annotations

import dataclasses

import pytest

from megatrain.planner.costs import cost_model, spill_placement, spill_timing
from megatrain.planner.shapes import model_shapes
from megatrain.plan.buffer_kinds import BufferKind
from megatrain.planner.profiling.hardware import HardwareProfile
from megatrain.plan.plan import Plan
from megatrain.planner.costs.spill_placement import Spilled
from megatrain.planner.costs.step_replay import BlockVisit
from megatrain.planner.shapes.workload import Workload

CHUNK = 262144                 # elements of one 1 MiB chunk
U = CHUNK * 4 / 1e9            # seconds of one block's kind (a chunk) at 1 GB/s
HEAD = 1024                    # the head block's elements (its norm)


def _hw(**kw: object) -> HardwareProfile:
    base = dict(gpu_name="cpu", gpu_mem_bytes=0, h2d_gbps=5.0, d2h_gbps=5.0, duplex_gbps=5.0,
                matmul_tflops={"float32": 0.1}, cpu_adam_params_per_s=1e9, host_ram_bytes=64 << 30,
                host_available_bytes=60 << 30, cores=2, disk_read_gbps=1.0, disk_write_gbps=1.0)
    return HardwareProfile(**{**base, **kw})


def _all(numels: tuple[int, ...]) -> Spilled:
    every = frozenset(range(len(numels)))
    return Spilled({k: every for k in BufferKind}, numels)


def _visits(fwd: list[float], bwd: list[float]) -> list[BlockVisit]:
    """Forward visits (embedding, layers, head) then backward (layers in reverse, embedding, which loads
    nothing): compute only, with a host copy of 1 s each that a spilled master does not pay."""
    back = [BlockVisit(1.0 if i < len(bwd) - 1 else 0.0, c, 0.0, backward=True) for i, c in enumerate(bwd)]
    return [BlockVisit(1.0, c, 0.0) for c in fwd] + back


def _plan(staging: int) -> Plan:
    return Plan(spill="all", spill_dir="/tmp", spill_staging=staging, spill_chunk_bytes=CHUNK * 4)


def test_the_step_by_hand() -> None:
    """Embedding, two layers of one chunk each, a tiny head; everything spilled; 1 GB/s each way; two staging
    sets: the backward reads the embedding's and layer 1's master, m and v ahead."""
    spilled = _all((CHUNK, CHUNK, CHUNK, HEAD))
    f, bwd = [0.001, 0.01, 0.01, 0.002], [0.02, 0.02, 0.001]
    got = spill_timing.cpu_step(spilled, _plan(2), _hw(), _visits(f, bwd), 4, 0.5, False, 4)
    h = HEAD * 4 / 1e9
    B = sum(bwd)
    # backward: the layers' loads (layer 2's U read; layer 1's master, read ahead for its update, copied from the
    # set at 5 GB/s: the runtime's [Note: lent masters]), every block's gradients (3 U + h written), 6 U read ahead
    lent = CHUNK * 4 / 5e9
    assert got.read_ahead_bytes == pytest.approx(6 * U * 1e9)
    assert got.backward_exposed_s == max(0.0, U + 3 * U + h + 6 * U - B - lent) == 0.0
    # forward: a_i = a_{i-1} + (4 U - ahead) reads + 3 U writes; the load takes the master its update wrote (no
    # disk read; a host copy at 5 GB/s on the CPU): e_i = max(e_{i-1}, a_i) + f_i + copy_i
    copy = [CHUNK * 4 / 5e9] * 3 + [HEAD * 4 / 5e9]
    a0 = U + 3 * U
    e0 = a0 + f[0] + copy[0]
    a1 = a0 + U + 3 * U
    e1 = max(e0, a1) + f[1] + copy[1]
    a2 = a1 + 4 * U + 3 * U
    e2 = max(e1, a2) + f[2] + copy[2]
    a3 = a2 + 7 * h
    e3 = max(e2, a3) + f[3] + copy[3]
    assert got.forward_s == pytest.approx(e3)
    assert got.forward_exposed_s == pytest.approx(e3 - sum(f) - sum(copy))
    assert got.step_s == pytest.approx(e3 + B + lent + 0.5)


def test_the_read_ahead_is_bounded_by_the_staging_sets_and_the_idle_disk() -> None:
    spilled = _all((4 * CHUNK, CHUNK, CHUNK, HEAD))   # an embedding of four chunks
    f, bwd = [0.001, 0.01, 0.01, 0.002], [0.02, 0.02, 0.001]
    by_sets = [spill_timing.cpu_step(spilled, _plan(p), _hw(), _visits(f, bwd), 4, 0.0, False, 4) for p in (1, 3)]
    assert [s.read_ahead_bytes for s in by_sets] == pytest.approx([3 * U * 1e9, 9 * U * 1e9])
    assert by_sets[1].forward_exposed_s == pytest.approx(by_sets[0].forward_exposed_s - 6 * U)
    # a short backward: its idle disk time, not the sets, bounds what is read ahead, and nothing is exposed there
    short = [0.006, 0.006, 0.001]
    busy = 2 * U + 6 * U + HEAD * 4 / 1e9             # the layers' loads, every block's gradients
    got = spill_timing.cpu_step(spilled, _plan(100), _hw(), _visits(f, short), 4, 0.0, False, 4)
    assert got.read_ahead_bytes == pytest.approx((sum(short) - busy) * 1e9)
    assert got.backward_exposed_s == pytest.approx(0.0, abs=1e-12)
    # a backward too short for its own loads and drains: exposed by the difference, nothing read ahead
    tiny = [0.0001, 0.0001, 0.0001]
    got = spill_timing.cpu_step(spilled, _plan(100), _hw(), _visits(f, tiny), 4, 0.0, False, 4)
    assert got.read_ahead_bytes == 0 and got.backward_exposed_s == pytest.approx(busy - sum(tiny))


def test_the_read_ahead_follows_the_runtime_chunks() -> None:
    """Chunks as buffer_kinds.spill_chunks cuts them, blocks in update (forward) order, only the spilled kinds
    of master, m and v."""
    spilled = Spilled({BufferKind.EXP_AVG: frozenset({1, 2}), BufferKind.EXP_AVG_SQ: frozenset({1, 2})},
                      (CHUNK, CHUNK + 1024, CHUNK, HEAD))
    got = spill_timing.read_ahead(spilled, CHUNK * 4, 3, float("inf"))
    assert got == [0.0, (CHUNK + 1024) * 8.0, CHUNK * 8.0, 0.0]  # block 1: two chunks, block 2: the third set
    assert spill_timing.read_ahead(spilled, CHUNK * 4, 3, 100.0) == [0.0, 100.0, 0.0, 0.0]


def test_the_cost_model_times_a_spilled_cpu_step_with_it() -> None:
    shape = model_shapes.from_config(dict(model_type="llama", vocab_size=4096, hidden_size=256,
                                          intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                                          num_key_value_heads=2))
    work = Workload(seq_len=128, batch=2, compute_dtype="fp32", clipping=True)
    hw = _hw(disk_read_gbps=2.0, disk_write_gbps=2.0)   # the backward leaves the disk idle time to read ahead
    few, many = (cost_model.estimate(shape, work, _plan(p).replace(micro_batch_size=2), hw) for p in (1, 64))
    assert many.step_seconds < few.step_seconds          # staging sets the backward fills pay
    spilled = spill_placement.Spilled.of(shape, _plan(1))
    assert spill_timing.applies(hw, _plan(1), spilled) and few.step_seconds >= few.disk_seconds  # never faster
    unclipped = dataclasses.replace(work, clipping=False)
    eager = cost_model.estimate(shape, unclipped, _plan(1).replace(optimizer_mode="eager"), hw)
    assert spill_timing.applies(hw, _plan(1).replace(optimizer_mode="eager"), spilled)
    assert eager.step_seconds >= eager.disk_seconds > 0
    assert not spill_timing.applies(hw.replace(gpu_name="H100", gpu_mem_bytes=80 << 30), _plan(1), spilled)


def test_the_eager_step_by_hand() -> None:
    """Embedding, one layer of one chunk, a tiny head; master, m and v spilled (eager spills no gradient); 1 GB/s
    each way; two staging sets (6 U). Each update follows its block's backward on the disk's one queue, behind
    the loads issued before; the disk's idle time, after the load the loader issues next, reads the next
    updates' master, m and v ahead in update order (the head, the layer, the embedding) within the sets; a load
    of a block whose update's chunks were read ahead copies the master from the set at the host copy rate
    (5 GB/s) instead of reading it (the runtime's [Note: lent masters])."""
    every = frozenset(range(3))
    spilled = Spilled({k: every for k in (BufferKind.MASTER, BufferKind.EXP_AVG, BufferKind.EXP_AVG_SQ)},
                      (CHUNK, CHUNK, HEAD))
    f, bwd, adam = [0.001, 0.01, 0.002], [0.02, 0.001], 0.003
    plan = _plan(2).replace(optimizer_mode="eager")
    assert spill_timing.staging_bytes(spilled, plan.spill_chunk_bytes, 2) == 2 * 3 * CHUNK * 4
    got = spill_timing.cpu_step(spilled, plan, _hw(), _visits(f, bwd), 3, adam, False, 4)
    h = HEAD * 4 / 1e9
    per = adam / (2 * CHUNK + HEAD)                           # AdamW arithmetic per element
    # forward: each spilled master read ahead of its compute (d), each compute after its read (c); the loads'
    # host copies unpaid. The embedding's compute is shorter than the layer's load: no idle disk. During the
    # layer's, with the head's load left room for, the sets fill: the head's 3 h, the layer's 3 U, 3 U - 3 h of
    # the embedding's.
    d, c = U, U + f[0]
    d, c = 2 * U, max(c, 2 * U) + f[1]
    assert c - h - d > 6 * U
    d += 6 * U
    copy_h, copy_u = HEAD * 4 / 5e9, CHUNK * 4 / 5e9          # the head's and the layer's master copied
    c = max(c, d) + f[2] + copy_h                             # the head, read ahead: copied, no read; sets full
    assert got.forward_s == pytest.approx(c) and got.forward_exposed_s == pytest.approx(c - sum(f) - copy_h)
    # backward, the layer: read ahead, its load copies it; the head's update, read ahead, writes 3 h once the
    # head's backward is done; the idle disk reads the embedding's last 3 h ahead
    start = max(c, d)
    d = max(d, c) + 3 * h
    c = start + bwd[0] + (CHUNK + HEAD) * per + copy_u
    # the embedding (no load): the layer's update writes 3 U behind it, then its own writes after its backward
    start = max(c, d)
    d = max(d, c) + 3 * U
    c = start + bwd[1] + CHUNK * per
    step = max(c, max(d, c) + 3 * U)
    assert got.step_s == pytest.approx(step) and got.eager
    assert got.update_exposed_s == got.backward_exposed_s == pytest.approx(step - got.forward_s - sum(bwd) - adam
                                                                           - copy_u)
    assert got.read_ahead_bytes == pytest.approx((6 * U + 3 * h) * 1e9)
    # one set: 3 U in the forward (the head's and most of the layer's), then the 3 h the head's update frees; the
    # embedding's reads wait for its update, after the last compute
    one = spill_timing.cpu_step(spilled, _plan(1).replace(optimizer_mode="eager"), _hw(), _visits(f, bwd), 3, adam,
                                False, 4)
    assert one.read_ahead_bytes == pytest.approx((3 * U + 3 * h) * 1e9) and one.step_s > got.step_s


@pytest.mark.parametrize("mode", ["deferred", "eager"])
def test_the_disks_cpu_time_adds_to_the_work_beside_it(mode: str) -> None:
    """k CPU seconds per GB the disk moves (the profile's ``disk_cpu_s_per_gb``): with a disk so fast the CPU
    never waits on it, the step grows by exactly k x the bytes moved beside CPU work: every byte of the deferred
    step (its loads, drains, read-ahead and updates), and every byte of the eager step but the embedding's
    update's writes, which follow the last compute."""
    numels = (CHUNK, CHUNK, CHUNK, HEAD)
    every = frozenset(range(4))
    spilled = _all(numels) if mode == "deferred" else Spilled(  # eager spills no gradient
        {k: every for k in (BufferKind.MASTER, BufferKind.EXP_AVG, BufferKind.EXP_AVG_SQ)}, numels)
    f, bwd = [0.001, 0.01, 0.01, 0.002], [0.02, 0.02, 0.001]
    plan = _plan(2).replace(optimizer_mode=mode)
    fast = dict(disk_read_gbps=1e6, disk_write_gbps=1e6)
    base = spill_timing.cpu_step(spilled, plan, _hw(**fast), _visits(f, bwd), 4, 0.5, False, 4)
    slow = spill_timing.cpu_step(spilled, plan, _hw(**fast, disk_cpu_s_per_gb=0.2), _visits(f, bwd), 4, 0.5,
                                 False, 4)
    state = CHUNK * 4 * 3 + HEAD * 4                            # one kind's bytes over the blocks
    if mode == "deferred":  # backward: the layers' loads (but layer 1's master, read ahead: copied), the gradients
        # written, the read-ahead; forward: the rest of master, m, v, grads read; 3 kinds written
        moved = 2 * CHUNK * 4 - CHUNK * 4 + state + 4 * state + 3 * state
    else:  # forward: every master loaded; backward: the layers' loads, the updates' reads (3 kinds, read ahead
        # or not) and their writes but the embedding's, the last; less the loads copied from the sets read ahead
        # (two sets, filled after the embedding's compute: the head's, the second layer's, all of the first
        # layer's but the head's share; in the backward both layers'), 4 chunks, a host copy in both runs
        moved = state + 2 * CHUNK * 4 + 3 * state + 3 * (state - CHUNK * 4) - 4 * CHUNK * 4
    assert slow.step_s - base.step_s == pytest.approx(0.2 * moved / 1e9)
    assert slow.forward_exposed_s == pytest.approx(base.forward_exposed_s, abs=1e-9)
