"""runtime/spill/read_ahead.py on its own, driven the way the AdamW worker drives it: what it reads ahead and when
(the next step's chunks in the known update order, once every job of a step is taken, and on through that step
while its jobs come one by one, within the staging bound, never a chunk of a block still held for the step
before), and when it drops what it read ahead (a chunk asked for out of that order, a cold-path write to the
files). Each log is checked against a hand-written expectation."""
from __future__ import annotations

import concurrent.futures as cf
import threading

import pytest
import torch

from megatrain.plan.buffer_kinds import BufferKind
from megatrain.runtime.device.event_log import EventLog
from megatrain.runtime.spill.read_ahead import ReadAhead
from megatrain.runtime.spill.spill_files import SpillFiles
from megatrain.runtime.spill.spill_io import PosixIO

M, A, V, G = BufferKind.MASTER, BufferKind.EXP_AVG, BufferKind.EXP_AVG_SQ, BufferKind.GRADS
# 1024 elements a chunk. Block 0: three chunks of master, m, v; block 1: one chunk of m, v; block 2: three chunks
# of m, v and gradients; block 3: nothing on disk.
NUMELS = [3000, 1024, 2500, 500]
PLACEMENT = {M: frozenset({0}), A: frozenset({0, 1, 2}), V: frozenset({0, 1, 2}), G: frozenset({2})}
ORDER = (2, 3, 1, 0)  # the known update order: every step's jobs come so


@pytest.fixture
def files(tmp_path):
    files = SpillFiles(NUMELS, PLACEMENT, str(tmp_path), PosixIO(threads=2), staging=3, chunk_bytes=4096)
    for kind, blocks in PLACEMENT.items():
        for b in blocks:
            files.write_block(kind, b, _values(kind, b, 0.0))
    yield files
    files.flush()
    files.close()


def _values(kind: BufferKind, b: int, shift: float) -> torch.Tensor:
    return torch.arange(NUMELS[b], dtype=torch.float32) + 10_000 * (list(BufferKind).index(kind) + 1) + shift


def _ops(log: EventLog) -> list[tuple]:
    ops = [(e.op, e.step, e.block, e.lo, e.phase) for e in log.entries]
    log.clear()
    return ops


def _reader(files: SpillFiles) -> tuple[ReadAhead, EventLog]:
    log = EventLog()
    log.enabled = True
    return ReadAhead(files, ORDER, log), log


def _update(ahead: ReadAhead, step: int, b: int, lo: int, n: int) -> None:
    """A chunk's update without its arithmetic: staged, its reads landed, written back."""
    staged = ahead.stage(step, b, lo, n, grads=True)
    if staged is not None:
        cf.wait(staged.reads)
        ahead.write_behind(step, b, n, staged)


def _whole_step(ahead: ReadAhead, step: int) -> None:
    for b in ORDER:
        ahead.taken(step, b)
        for lo, n in ahead.pieces(b):
            _update(ahead, step, b, lo, n)


def test_pieces_are_the_spill_chunks_or_the_whole_block(files) -> None:
    ahead, _ = _reader(files)
    assert ahead.depth == 3
    assert ahead.pieces(0) == [(0, 1024), (1024, 1024), (2048, 952)]
    assert ahead.pieces(1) == [(0, 1024)]
    assert ahead.pieces(3) == [(0, 500)]


def test_reads_the_next_steps_chunks_ahead_in_the_known_order_within_the_bound(files) -> None:
    ahead, log = _reader(files)
    # Step 1: nothing is read ahead before every job of the step is taken.
    for b in ORDER[:3]:
        ahead.taken(1, b)
    ahead.read_ahead()
    assert _ops(log) == []
    ahead.taken(1, 0)
    held = ahead.stage(1, 0, 0, 1024, grads=True)  # block 0's first chunk, in flight
    assert held is not None and set(held.buffers) == {M, A, V}
    assert ahead.stage(1, 3, 0, 500, grads=True) is None  # nothing of block 3 is on disk: no set, no read
    ahead.read_ahead()  # two sets free, but step 2's first chunk is block 2's: read ahead
    assert _ops(log) == [("spill_read", 1, 0, 0, ""),
                         ("spill_read", 2, 2, 0, "ahead"), ("spill_read", 2, 2, 1024, "ahead")]
    cf.wait(held.reads)
    ahead.write_behind(1, 0, 1024, held)
    ahead.read_ahead()  # the third set back: the next chunk in order
    ahead.read_ahead()  # the bound: three sets, all read ahead
    assert _ops(log) == [("spill_write", 1, 0, 0, ""), ("spill_read", 2, 2, 2048, "ahead")]

    # Step 2 in the known order, its jobs one by one (as eager updates come): each chunk read ahead is taken (only
    # its gradients are read now), none dropped, and while the worker waits for the next job the chunks of the jobs
    # still to come are read ahead, within the bound.
    ahead.taken(2, 2)
    first = ahead.stage(2, 2, 0, 1024, grads=True)
    assert first is not None and set(first.buffers) == {A, V, G}
    cf.wait(first.reads)
    for kind in (A, V, G):
        assert torch.equal(first.buffers[kind][:1024], _values(kind, 2, 0.0)[:1024])
    ahead.write_behind(2, 2, 1024, first)
    ahead.read_ahead()  # block 1's chunk: its job has not come
    _update(ahead, 2, 2, 1024, 1024)
    _update(ahead, 2, 2, 2048, 452)
    ahead.taken(2, 3)
    ahead.taken(2, 1)
    ahead.read_ahead()  # block 0's first two chunks: three sets held with block 1's
    _update(ahead, 2, 1, 0, 1024)
    ahead.taken(2, 0)  # the step's last job: the list is step 3's now, block 0's third chunk is read as it comes
    for lo, n in ahead.pieces(0):
        _update(ahead, 2, 0, lo, n)
    assert _ops(log) == [("spill_write", 2, 2, 0, ""), ("spill_read", 2, 1, 0, "ahead"),
                         ("spill_write", 2, 2, 1024, ""), ("spill_write", 2, 2, 2048, ""),
                         ("spill_read", 2, 0, 0, "ahead"), ("spill_read", 2, 0, 1024, "ahead"),
                         ("spill_write", 2, 1, 0, ""),
                         ("spill_write", 2, 0, 0, ""), ("spill_write", 2, 0, 1024, ""),
                         ("spill_read", 2, 0, 2048, ""), ("spill_write", 2, 0, 2048, "")]
    # Every job of step 2 taken: step 3's first chunks are next, block 2's again.
    ahead.read_ahead()
    assert _ops(log) == [("spill_read", 3, 2, 0, "ahead"), ("spill_read", 3, 2, 1024, "ahead"),
                         ("spill_read", 3, 2, 2048, "ahead")]
    ahead.drop()
    assert [op[0] for op in _ops(log)] == ["spill_discard"] * 3


def test_a_chunk_out_of_the_known_order_drops_what_was_read_ahead(files) -> None:
    ahead, log = _reader(files)
    _whole_step(ahead, 1)
    ahead.read_ahead()
    _ops(log)
    # Step 2's jobs come in another order: block 1 first. Everything read ahead is dropped, block 1 read afresh,
    # and nothing more is read ahead for step 2.
    ahead.taken(2, 1)
    _update(ahead, 2, 1, 0, 1024)
    ahead.read_ahead()
    assert _ops(log) == [("spill_discard", 2, 2, 0, ""), ("spill_discard", 2, 2, 1024, ""),
                         ("spill_discard", 2, 2, 2048, ""), ("spill_read", 2, 1, 0, ""),
                         ("spill_write", 2, 1, 0, "")]
    for b in (2, 3, 0):
        ahead.taken(2, b)
        for lo, n in ahead.pieces(b):
            _update(ahead, 2, b, lo, n)
    assert all(op[4] == "" and op[0] != "spill_discard" for op in _ops(log))
    # Every job of step 2 was taken: step 3's first chunks are read ahead again, in the known order.
    ahead.read_ahead()
    assert _ops(log) == [("spill_read", 3, 2, 0, "ahead"), ("spill_read", 3, 2, 1024, "ahead"),
                         ("spill_read", 3, 2, 2048, "ahead")]
    ahead.drop()  # the worker closing: what is read ahead goes back to the pool
    assert _ops(log) == [("spill_discard", 3, 2, 0, ""), ("spill_discard", 3, 2, 1024, ""),
                         ("spill_discard", 3, 2, 2048, "")]


def test_a_cold_path_write_drops_what_was_read_ahead_and_the_chunk_is_read_again(files) -> None:
    ahead, log = _reader(files)
    _whole_step(ahead, 1)
    ahead.read_ahead()
    _ops(log)
    files.write_block(A, 2, _values(A, 2, 0.5))  # e.g. a state dict loaded between the steps
    ahead.taken(2, 2)
    staged = ahead.stage(2, 2, 0, 1024, grads=True)
    assert staged is not None and set(staged.buffers) == {A, V, G}
    cf.wait(staged.reads)
    assert torch.equal(staged.buffers[A][:1024], _values(A, 2, 0.5)[:1024])  # the new bytes, not the stale ones
    ahead.write_behind(2, 2, 1024, staged)
    assert _ops(log) == [("spill_discard", 2, 2, 0, ""), ("spill_discard", 2, 2, 1024, ""),
                         ("spill_discard", 2, 2, 2048, ""), ("spill_read", 2, 2, 0, ""),
                         ("spill_write", 2, 2, 0, "")]


def test_a_chunk_waits_while_its_block_is_held_for_the_step_before(files) -> None:
    ahead, log = _reader(files)
    ahead.taken(1, 2)
    held = [ahead.stage(1, 2, lo, n, grads=True) for lo, n in ahead.pieces(2)]  # every set: block 2's chunks
    for b in ORDER[1:]:
        ahead.taken(1, b)  # every job of step 1 taken: step 2's list begins with block 2
    cf.wait(held[0].reads)
    ahead.write_behind(1, 2, 1024, held[0])
    ahead.read_ahead()  # a set is free, but block 2 has chunks of step 1 not yet written behind
    assert _ops(log) == [("spill_read", 1, 2, 0, ""), ("spill_read", 1, 2, 1024, ""), ("spill_read", 1, 2, 2048, ""),
                         ("spill_write", 1, 2, 0, "")]
    for staged, (lo, n) in zip(held[1:], ahead.pieces(2)[1:]):
        cf.wait(staged.reads)
        ahead.write_behind(1, 2, n, staged)
    ahead.read_ahead()
    assert _ops(log) == [("spill_write", 1, 2, 1024, ""), ("spill_write", 1, 2, 2048, ""),
                         ("spill_read", 2, 2, 0, "ahead"), ("spill_read", 2, 2, 1024, "ahead"),
                         ("spill_read", 2, 2, 2048, "ahead")]


class _GatedIO(PosixIO):
    """POSIX I/O whose writes land only while ``gate`` is set: a staging set stays in write-back at will."""

    def __init__(self, threads: int) -> None:
        super().__init__(threads)
        self.gate = threading.Event()
        self.gate.set()
        self._held = cf.ThreadPoolExecutor(max_workers=1)

    def write(self, handle: int, offset: int, src: torch.Tensor) -> cf.Future:
        landed: cf.Future = cf.Future()

        def run() -> None:
            self.gate.wait()
            try:
                PosixIO.write(self, handle, offset, src).result()
                landed.set_result(None)
            except BaseException as e:
                landed.set_exception(e)
        self._held.submit(run)
        return landed

    def close(self) -> None:
        self.gate.set()
        self._held.shutdown(wait=True)
        super().close()


@pytest.fixture
def gated(tmp_path, request):
    io = _GatedIO(threads=request.param)
    files = SpillFiles(NUMELS, PLACEMENT, str(tmp_path), io, staging=3, chunk_bytes=4096)
    for kind, blocks in PLACEMENT.items():
        for b in blocks:
            files.write_block(kind, b, _values(kind, b, 0.0))
    yield io, files
    io.gate.set()
    files.flush()
    files.close()


def _all_sets_back(files: SpillFiles) -> None:
    """Wait until every staging set is back in the pool (the writes behind landed)."""
    for index in [files.staging.acquire() for _ in range(files.staging.count)]:
        files.staging.release(index)


def _woken_reads(ahead: ReadAhead, log: EventLog, landing: cf.Future | None, count: int) -> list[tuple]:
    """Read ahead each time the landing it returned comes (a transfer landed, a set may be back) until ``count``
    chunks are read."""
    ops: list[tuple] = []
    while len(ops) < count:
        assert landing is not None, f"nothing to wait for after {ops}"
        landing.result(timeout=30)
        landing = ahead.read_ahead(idle=True)
        ops += _ops(log)
    return ops


@pytest.mark.parametrize("gated", [4], indirect=True)
def test_with_a_wake_the_read_ahead_never_waits_for_a_set_being_written_back(gated) -> None:
    io, files = gated
    ahead, log = _reader(files)
    _whole_step(ahead, 1)
    ahead.read_ahead()  # no wake: waits for the sets step 1 wrote back, and reads step 2's first three chunks
    io.gate.clear()
    ahead.taken(2, 2)
    first = ahead.stage(2, 2, 0, 1024, grads=True)
    assert first is not None
    cf.wait(first.reads)
    ahead.write_behind(2, 2, 1024, first)  # its set stays in write-back while the gate is shut
    _ops(log)
    landing = ahead.read_ahead(idle=True)  # room for one more chunk, but no set free: returns at once, nothing read
    assert _ops(log) == [] and landing is not None and not landing.done()
    io.gate.set()  # the writes land, the set is back: the worker's wait ends and it reads the next chunk ahead
    assert _woken_reads(ahead, log, landing, 1) == [("spill_read", 2, 1, 0, "ahead")]
    ahead.drop()


def _two_transfers_in_flight(io, files, kind, block: int) -> None:
    """The disk's gate shut and two writes of ``block``'s ``kind`` in flight behind it: a busy disk."""
    io.gate.clear()
    for lo in (0, 1024):
        files.write_async(kind, block, _values(kind, block, 0.0)[lo:lo + 1024], lo, 1024)


@pytest.mark.parametrize("gated", [2], indirect=True)
def test_with_a_wake_the_read_ahead_reads_only_into_the_disks_idle_time(gated) -> None:
    io, files = gated
    ahead, log = _reader(files)
    _whole_step(ahead, 1)
    _all_sets_back(files)
    _ops(log)
    _two_transfers_in_flight(io, files, M, 0)  # not reads ahead (a load's reads, say)
    landing = ahead.read_ahead(idle=True)  # three sets free, but the disk is busy: nothing read
    assert _ops(log) == [] and landing is not None and not landing.done()
    io.gate.set()  # as transfers land, the chunks in order (two reads each: a chunk fills the disk again)
    assert _woken_reads(ahead, log, landing, 3) == [("spill_read", 2, 2, 0, "ahead"), ("spill_read", 2, 2, 1024, "ahead"),
                                                  ("spill_read", 2, 2, 2048, "ahead")]
    ahead.drop()


@pytest.mark.parametrize("gated", [2], indirect=True)
def test_once_a_steps_jobs_come_its_chunks_are_read_into_free_sets_busy_disk_or_not(gated) -> None:
    io, files = gated
    ahead, log = _reader(files)
    _whole_step(ahead, 1)  # every job of step 1 taken: step 2's chunks are the list
    ahead.taken(2, 2)  # step 2's jobs come: block 2's first, its chunks read as it asks for them
    for lo, n in ahead.pieces(2):
        _update(ahead, 2, 2, lo, n)
    ahead.taken(2, 3)  # nothing of block 3 on disk
    _all_sets_back(files)
    _ops(log)
    _two_transfers_in_flight(io, files, G, 2)  # not reads ahead (of a block not read next)
    ahead.read_ahead(idle=True)  # the disk is busy, but these are the chunks of the jobs to come: read into the sets
    assert _ops(log) == [("spill_read", 2, 1, 0, "ahead"), ("spill_read", 2, 0, 0, "ahead"),
                         ("spill_read", 2, 0, 1024, "ahead")]
    out = torch.empty(1024)  # block 0's coming load copies its master from the set read ahead
    assert files.lent.copy(2, 0, 0, out, files.version)
    assert torch.equal(out, _values(M, 0, 0.0)[:1024])
    ahead.read_ahead(idle=True)  # every set held: nothing more, and no wait for one
    assert _ops(log) == []
    io.gate.set()
    ahead.drop()


@pytest.mark.parametrize("gated", [2], indirect=True)
def test_the_next_steps_chunks_wait_for_the_idle_disk_even_with_sets_free(gated) -> None:
    io, files = gated
    ahead, log = _reader(files)
    _whole_step(ahead, 1)
    _whole_step(ahead, 2)  # step 2's last job taken: the list is step 3's
    _all_sets_back(files)
    _ops(log)
    io.gate.clear()
    files.write_async(G, 2, _values(G, 2, 0.0)[:1024], 0, 1024)  # a transfer in flight
    landing = ahead.read_ahead(idle=True)
    assert _ops(log) == [] and landing is not None
    io.gate.set()
    assert _woken_reads(ahead, log, landing, 1)[0] == ("spill_read", 3, 2, 0, "ahead")
    ahead.drop()
