"""The NVMe tier: spill files change where state lives, never the numbers."""
from __future__ import annotations

import collections
import errno
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatrain.runtime import Engine, MegatrainError, ModelConfig, OptimizerConfig, Plan, PlanError
from megatrain.plan.buffer_kinds import SPILL_ALIGN as DIRECT_ALIGN
from megatrain.plan.plan import SpillBlocks
from megatrain.runtime.spill.spill_io import PosixIO, SpillError, aligned_empty


@st.composite
def spill_cases(draw):
    config = ModelConfig(
        vocab_size=draw(st.integers(8, 64)), hidden_size=draw(st.sampled_from([16, 24, 32])),
        intermediate_size=draw(st.integers(8, 64)), num_hidden_layers=draw(st.integers(1, 3)),
        num_attention_heads=4, num_key_value_heads=draw(st.sampled_from([1, 2, 4])),
        tie_word_embeddings=draw(st.booleans()), attention_bias=draw(st.booleans()),
    )
    clip = draw(st.one_of(st.none(), st.just(1.0)))
    mode = "deferred" if clip is not None or draw(st.booleans()) else "eager"
    base = dict(micro_batch_size=draw(st.integers(1, 3)), optimizer_mode=mode,
                checkpoints=draw(st.sampled_from(["device", "host"])), host_grad_slabs=draw(st.integers(1, 3)))
    kind = draw(st.sampled_from(["optimizer", "all", "blocks"]))
    blocks = None
    if kind == "blocks":  # each kind on disk for a random subset of the blocks (0 embedding .. L + 1 head)
        subset = st.lists(st.integers(0, config.num_hidden_layers + 1), unique=True)
        blocks = SpillBlocks(**{k: draw(subset) for k in ("master", "exp_avg", "exp_avg_sq", "grads")})
        if blocks.empty:
            blocks = SpillBlocks(master=(0,))
    spill = dict(spill=kind, spill_blocks=blocks, spill_staging=draw(st.integers(1, 3)),
                 io_threads=draw(st.integers(1, 3)), io_backend="posix",
                 # 4 KiB: blocks and single tensors split into many chunks; 64 MiB: every block whole.
                 spill_chunk_bytes=draw(st.sampled_from([4096, 8192, 64 * 2**20])))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    steps = draw(st.integers(1, 3))
    return config, clip, base, spill, dtype, steps, draw(st.integers(0, 1000))


@settings(deadline=None, max_examples=25)
@given(spill_cases())
def test_spill_on_equals_spill_off(tmp_path_factory, case):
    config, clip, base, spill, dtype, steps, seed = case
    spill_dir = str(tmp_path_factory.mktemp("spill"))
    results = []
    for plan in (Plan(**base), Plan(**base, **spill, spill_dir=spill_dir)):
        with Engine(config, OptimizerConfig(lr=1e-3, max_grad_norm=clip), plan=plan, compute_dtype=dtype,
                    device="cpu", seed=seed) as engine:
            gen = torch.Generator().manual_seed(seed)
            losses = []
            for _ in range(steps):
                ids = torch.randint(0, config.vocab_size, (3, 9), generator=gen)
                losses.append(engine.step(ids, ids))
            results.append((torch.stack(losses), engine.state_dict(), engine.optimizer_state_dict()))
            b = plan.spill_blocks
            only_grads = b is not None and not (b.master or b.exp_avg or b.exp_avg_sq)
            if plan.spill != "none" and not (only_grads and plan.optimizer_mode == "eager"):  # eager: no grads file
                assert engine.store.spilled and engine.store.nvme_bytes > 0
    (la, pa, oa), (lb, pb, ob) = results
    assert torch.equal(la, lb)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    for k in oa:
        assert all(torch.equal(oa[k][f], ob[k][f]) for f in ("exp_avg", "exp_avg_sq", "step")), k
    assert os.listdir(spill_dir) == [], "spill files left behind after close"


def test_spill_moves_state_out_of_ram(tmp_path):
    config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4)
    sizes = {}
    for spill in ("none", "optimizer", "all"):
        plan = Plan(spill=spill, spill_dir=str(tmp_path) if spill != "none" else None, spill_staging=1)
        with Engine(config, plan=plan, compute_dtype=torch.bfloat16, device="cpu") as engine:
            sizes[spill] = (engine.store.nbytes, engine.store.nvme_bytes)
    assert sizes["none"][1] == 0
    assert sizes["optimizer"][1] >= 2 * 4 * 64 * 256 and sizes["optimizer"][0] < sizes["none"][0]
    assert sizes["all"][1] > sizes["optimizer"][1] and sizes["all"][0] < sizes["optimizer"][0]


def _one_line(e):
    assert "\n" not in str(e.value), str(e.value)


def test_bad_spill_dirs(tmp_path):
    config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    afile = tmp_path / "not-a-dir"
    afile.write_text("x")
    for where, words in [(str(tmp_path / "missing"), "not a directory"), (str(afile), "not a directory")]:
        with pytest.raises(SpillError) as e:
            Engine(config, plan=Plan(spill="all", spill_dir=where), device="cpu")
        _one_line(e)
        assert words in str(e.value) and where in str(e.value)
    with pytest.raises(PlanError) as e:
        Plan(spill="optimizer")
    assert "spill_dir" in str(e.value)


def test_disk_too_small_fails_at_start(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(SpillError) as e:
        Engine(config, plan=Plan(spill="all", spill_dir=str(tmp_path)), device="cpu")
    _one_line(e)
    assert "in all" in str(e.value) and "free" in str(e.value) and "spill_dir" in str(e.value)
    assert os.listdir(tmp_path) == [], "a failed start left files behind"


def test_io_error_mid_step_stops_training_clearly(tmp_path, monkeypatch):
    config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2)
    engine = Engine(config, OptimizerConfig(max_grad_norm=1.0), plan=Plan(spill="all", spill_dir=str(tmp_path),
                                                                          io_backend="posix"), device="cpu")
    ids = torch.randint(0, 32, (2, 8))
    engine.step(ids, ids)
    engine.synchronize()
    real = os.pwritev

    def failing(fd, buffers, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pwritev", failing)
    with pytest.raises(MegatrainError) as e:
        for _ in range(3):
            engine.step(ids, ids)
        engine.synchronize()
    _one_line(e)
    assert "Input/output error" in str(e.value) and "training stopped" in str(e.value)
    monkeypatch.setattr(os, "pwritev", real)
    engine.close()


@settings(deadline=None, max_examples=60)
@given(st.data())
def test_posix_backend_round_trips_at_any_offset(tmp_path_factory, data):
    path = str(tmp_path_factory.mktemp("io") / "f.bin")
    size = data.draw(st.integers(1, 5 * DIRECT_ALIGN + 17))
    io = PosixIO(threads=data.draw(st.integers(1, 3)))
    try:
        handle = io.open(path, size)
        expected = torch.zeros(size, dtype=torch.uint8)
        for _ in range(data.draw(st.integers(1, 6))):
            offset = data.draw(st.integers(0, size - 1))
            n = data.draw(st.integers(1, size - offset))
            aligned = data.draw(st.booleans())
            src = aligned_empty(n) if aligned else torch.empty(n + 1, dtype=torch.uint8)[1:]
            src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
            io.write(handle, offset, src).result()
            expected[offset:offset + n] = src
        out = aligned_empty(size)
        io.read(handle, 0, out).result()
        assert torch.equal(out, expected)
        offset = data.draw(st.integers(0, size - 1))
        part = torch.empty(size - offset, dtype=torch.uint8)
        io.read(handle, offset, part).result()
        assert torch.equal(part, expected[offset:])
    finally:
        io.close()


def test_a_loads_read_runs_before_the_transfers_queued_ahead_of_it(tmp_path, monkeypatch):
    """PosixIO's one thread busy with a write: a read issued ``first`` (a load's, which compute waits for) runs
    before the writes queued earlier, and those keep their order."""
    io = PosixIO(threads=1)
    started, gate, ran = threading.Event(), threading.Event(), []
    real_write, real_read = os.pwritev, os.preadv

    def write(fd, buffers, offset):
        if not ran:
            started.set()
            gate.wait(timeout=30)
        ran.append(("write", offset))
        return real_write(fd, buffers, offset)

    def read(fd, buffers, offset):
        ran.append(("read", offset))
        return real_read(fd, buffers, offset)
    try:
        handle = io.open(str(tmp_path / "f.bin"), 4 * DIRECT_ALIGN)
        monkeypatch.setattr(os, "pwritev", write)
        monkeypatch.setattr(os, "preadv", read)
        src = aligned_empty(DIRECT_ALIGN)
        writes = [io.write(handle, 0, src)]
        assert started.wait(timeout=30)  # the thread is in the first write: the rest queue
        writes += [io.write(handle, i * DIRECT_ALIGN, src) for i in (1, 2)]
        load = io.read(handle, 3 * DIRECT_ALIGN, aligned_empty(DIRECT_ALIGN), first=True)
        gate.set()
        for f in [*writes, load]:
            f.result()
    finally:
        io.close()
    assert ran == [("write", 0), ("read", 3 * DIRECT_ALIGN), ("write", DIRECT_ALIGN), ("write", 2 * DIRECT_ALIGN)]


def test_trains_a_model_whose_state_is_1_5x_the_ram_allowed(tmp_path):
    """In a subprocess whose address space is capped: without spill it runs out of memory, with it it trains."""
    script = textwrap.dedent(f"""
        import resource, sys, torch
        from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan
        spill = sys.argv[1]
        spill_dir = {str(tmp_path)!r}
        def vm():
            return int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        # Warm up (imports, first kernels) on a tiny model, so that the cap counts only this model's needs.
        tiny = Engine(ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                  num_attention_heads=1), plan=Plan(spill="all", spill_dir=spill_dir), device="cpu")
        tiny.step(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
        tiny.close()
        config = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=24,
                             num_attention_heads=8, num_key_value_heads=2)
        n = 24 * (2 * 256 * 256 + 2 * 256 * 64 + 3 * 256 * 768 + 2 * 256) + 2 * 1024 * 256 + 256
        state = 18 * n                       # fp32 master, m, v, grads and the bf16 shadow
        allowed = int(state / 1.5)
        # 40 MiB on top: the new engine's worker threads' stacks (address space, not memory).
        resource.setrlimit(resource.RLIMIT_AS, (vm() + allowed + 40 * 2**20, resource.RLIM_INFINITY))
        plan = Plan(spill=spill, spill_dir=spill_dir if spill != "none" else None, spill_staging=2)
        try:
            engine = Engine(config, OptimizerConfig(lr=1e-3), plan=plan, compute_dtype=torch.bfloat16, device="cpu")
            assert engine.num_parameters == n
            ids = torch.randint(0, 1024, (2, 16))
            losses = [engine.step(ids, ids).item() for _ in range(2)]
            engine.close()
        except (MemoryError, RuntimeError) as e:
            print("OOM", type(e).__name__)
            sys.exit(3)
        print("OK", state, allowed, losses[0], losses[-1])
    """)
    runs = {}
    # One malloc arena and a fixed mmap threshold: glibc would otherwise reserve 64 MiB of address space
    # per thread arena and keep freed buffers, which a cap on address space counts as memory; one
    # OpenMP thread, whose stacks it counts too.
    env = dict(os.environ, MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    for spill in ("none", "all"):
        proc = subprocess.run([sys.executable, "-c", script, spill], capture_output=True, text=True, timeout=300,
                              env=env)
        runs[spill] = (proc.returncode, proc.stdout.strip())
    assert runs["none"][0] == 3, runs  # the cap is real: the whole state does not fit
    assert runs["all"][0] == 0, runs
    _, state, allowed, first, last = runs["all"][1].split()
    assert int(state) >= 1.5 * int(allowed) - 2 and float(last) < float(first)


def test_checkpoints_and_exports_move_between_spill_and_ram(tmp_path):
    """A checkpoint written by a spilling engine resumes in RAM (and back) with the same numbers;
    save_pretrained / from_pretrained work through spill files too."""
    config = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, tie_word_embeddings=True)
    opt = OptimizerConfig(lr=1e-3, max_grad_norm=1.0)
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    spill = Plan(spill="all", spill_dir=str(spill_dir), spill_staging=2)
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    with Engine(config, opt, plan=spill, compute_dtype=torch.float32, device="cpu") as a:
        for _ in range(2):
            a.step(ids, ids)
        a.save_checkpoint(str(tmp_path / "ckpt")).wait()
        a.save_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
        a.step(ids, ids)
        expected, expected_state = a.state_dict(), a.optimizer_state_dict()
    for plan in (Plan(), spill):  # resume into RAM, and into spill files again
        with Engine.load_checkpoint(str(tmp_path / "ckpt"), plan=plan) as b:
            assert b.step_count == 2
            b.step(ids, ids)
            got, state = b.state_dict(), b.optimizer_state_dict()
            assert all(torch.equal(expected[k], got[k]) for k in expected)
            assert all(torch.equal(expected_state[k]["exp_avg_sq"], state[k]["exp_avg_sq"]) for k in state)
    with Engine.from_pretrained(str(tmp_path / "hf"), plan=spill, compute_dtype=torch.float32, device="cpu") as c, \
            Engine.from_pretrained(str(tmp_path / "hf"), compute_dtype=torch.float32, device="cpu") as d:
        assert torch.equal(c.logits(ids), d.logits(ids))


def test_io_error_leaves_the_last_checkpoint_intact(tmp_path, monkeypatch):
    config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2)
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    engine = Engine(config, OptimizerConfig(max_grad_norm=1.0), plan=Plan(spill="all", spill_dir=str(spill_dir),
                                                                          io_backend="posix"), device="cpu")
    ids = torch.randint(0, 32, (2, 8))
    engine.step(ids, ids)
    engine.save_checkpoint(str(tmp_path / "ckpt")).wait()
    saved = engine.state_dict()
    monkeypatch.setattr(os, "pwritev", lambda fd, buffers, offset: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
    with pytest.raises(MegatrainError):
        for _ in range(3):
            engine.step(ids, ids)
        engine.synchronize()
    monkeypatch.undo()
    engine.close()
    with Engine.load_checkpoint(str(tmp_path / "ckpt"), plan=Plan()) as resumed:
        got = resumed.state_dict()
        assert all(torch.equal(saved[k], got[k]) for k in saved)


def test_disk_probe_times_a_rewrite_with_o_direct_where_the_filesystem_takes_it(tmp_path, monkeypatch):
    """The probe writes every request twice and reads it once (a step rewrites spill files written before: the
    first write, into fresh extents, is not what a step pays); O_DIRECT where the filesystem takes it, buffered
    where it is refused, and the third figure says which. Each request moves its own buffer, as each spill chunk
    has its own, and no two pages it writes are alike, as no two pages of a model's state are (on this project's
    virtual disk pages alike moved at half the speed)."""
    from megatrain.planner.profiling import host_probe

    writes: collections.Counter = collections.Counter()
    reads: collections.Counter = collections.Counter()
    read_into: dict[int, int] = {}
    pages: dict[bytes, int] = {}  # each written page's first 8 bytes: how many pages began so
    real_write, real_read = os.pwritev, os.preadv

    def pwritev(fd, buffers, offset):
        writes[offset] += 1
        view = memoryview(buffers[0])
        if writes[offset] == 2 and len(view) > 4096:  # one whole write of each request
            for page in range(0, len(view), 4096):
                head = bytes(view[page:page + 8])
                pages[head] = pages.get(head, 0) + 1
        return real_write(fd, buffers, offset)

    def preadv(fd, buffers, offset):
        reads[offset] += 1
        read_into[offset] = id(buffers[0])
        return real_read(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "preadv", preadv)
    request = 2**20
    _, _, direct = host_probe.disk_bandwidth(str(tmp_path), 8 * request, threads=2, request=request, repeats=1)
    offsets = [i * request for i in range(8)]
    # (the O_DIRECT pass first writes one page at 0 to see whether the filesystem takes it)
    assert [writes[o] - (o == 0 and direct) for o in offsets] == [2] * 8 and [reads[o] for o in offsets] == [1] * 8
    assert len(set(read_into.values())) == 8  # a buffer per request
    assert len(pages) == 8 * request // 4096 and set(pages.values()) == {1}  # no two pages alike
    if not direct:
        pytest.skip("this filesystem refuses O_DIRECT: the buffered pass ran, as checked below")
    monkeypatch.delattr(os, "O_DIRECT")
    writes.clear()
    assert host_probe.disk_bandwidth(str(tmp_path), 8 * request, threads=2, request=request, repeats=1)[2] is False
    assert [writes[o] for o in offsets] == [2] * 8
    assert os.listdir(tmp_path) == []


def test_io_direct_follows_the_plan_and_the_profile_says_which_mode_it_measured(tmp_path):
    """Plan.io_direct=False keeps the POSIX backend buffered; the profile's disk pass returns both directions'
    figures and whether they are O_DIRECT's, and the search's plans follow it (reads apart only when a plan says
    so)."""
    from megatrain.planner.choice import spill_choices
    from megatrain.planner.profiling.hardware import preset
    from megatrain.planner.profiling.host_probe import disk_bandwidth

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    for direct in (True, False):
        plan = Plan(spill="all", spill_dir=str(tmp_path), io_backend="posix", io_direct=direct)
        with Engine(config, plan=plan, compute_dtype=torch.float32, device="cpu") as engine:
            io = engine.store.disk.io
            assert not direct and not io.direct or direct  # buffered when the plan says so
    read, write, direct = disk_bandwidth(str(tmp_path), 16 * 2**20, threads=2, request=2**20, repeats=2)
    assert read > 0 and write > 0 and direct in (True, False)
    assert os.listdir(tmp_path) == []
    hw = preset("H100-SXM")
    assert spill_choices.spill_io_choices(hw.replace(disk_direct_faster=False)) == {"io_direct": False}
    assert spill_choices.spill_io_choices(hw.replace(disk_direct_faster=True)) == {"io_direct": True}
    assert Plan(io_direct=True, io_direct_reads=False).direct_reads is False
    assert Plan(io_direct=False).direct_reads is False and Plan().direct_reads is True
    with pytest.raises(PlanError, match="io_direct"):
        Plan(io_direct="yes")
    with pytest.raises(PlanError, match="io_direct_reads"):
        Plan(io_direct_reads="no")


@pytest.mark.parametrize("direct,reads", [(True, False), (False, True)])
def test_direct_writes_and_buffered_reads_train_as_in_ram(tmp_path, direct, reads):
    """Each direction in its own mode (O_DIRECT writes with buffered reads, and the other way round): the spilled
    run's weights and AdamW state after 3 steps equal the same run's with everything in RAM, bit for bit."""
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    states = []
    for plan in (Plan(), Plan(spill="all", spill_dir=str(tmp_path), io_backend="posix", io_direct=direct,
                              io_direct_reads=reads, spill_chunk_bytes=4096)):
        with Engine(config, plan=plan, compute_dtype=torch.float32, device="cpu", seed=3) as engine:
            for _ in range(3):
                engine.step(ids, ids)
            engine.synchronize()
            states.append((engine.state_dict(), engine.optimizer_state_dict()))
    (w0, o0), (w1, o1) = states
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert all(torch.equal(o0[k][s], o1[k][s]) for k in o0 for s in o0[k])


def test_the_disk_contention_probe_streams_through_a_buffer_each_with_no_two_pages_alike(tmp_path, monkeypatch):
    """disk_contention moves its I/O as the disk probe does (``host_probe.io_buffers``: a buffer per stream, no two
    pages alike; pages alike moved at half the speed on this project's disk), and gives a CPU cost per GB that is
    a number >= 0."""
    from megatrain.planner.profiling import disk_contention, host_probe

    bufs = host_probe.io_buffers(3, 4 * 4096)
    heads = [bytes(b[p:p + 8]) for b in bufs for p in range(0, 4 * 4096, 4096)]
    assert len(set(heads)) == 12 and all(len(b) == 4 * 4096 for b in bufs)
    used: set = set()
    real_write, real_read = os.pwritev, os.preadv

    def record(real):
        def op(fd, buffers, offset):
            used.add(id(buffers[0]))
            return real(fd, buffers, offset)
        return op

    monkeypatch.setattr(os, "pwritev", record(real_write))
    monkeypatch.setattr(os, "preadv", record(real_read))
    request = 2**20
    lost = disk_contention.cpu_seconds_per_gb(str(tmp_path), False, lambda: sum(range(1000)), seconds=0.2,
                                              threads=4, request=request, file_bytes=8 * request)
    assert lost >= 0.0 and len(used) == 4  # the four streams' buffers
    assert os.listdir(tmp_path) == []
