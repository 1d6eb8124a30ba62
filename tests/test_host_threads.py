"""Helper threads' intra-op threads ([Note: helper threads]): on a CPU device the AdamW worker runs its kernels on
one thread, so it never builds an OpenMP team beside the compute thread's, and nobody else's count changes; on a GPU
a rank of a data-parallel run takes its share of its node's cores, as the planner times it."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan
from megatrain.runtime.device import host_threads

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture
def two_threads():
    """Two intra-op threads on the calling thread, its OpenMP team built (whatever OMP_NUM_THREADS says)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.ones(1 << 22).add_(1)  # a parallel kernel: the team exists from here on
    yield
    torch.set_num_threads(before)


def _count_in_new_thread() -> int:
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    return seen[0]


def test_a_one_thread_helper_runs_on_one_thread_and_changes_no_other_threads_count(two_threads) -> None:
    seen: list[int] = []
    done = threading.Event()

    def work() -> None:
        torch.ones(1 << 22).mul_(2)  # a kernel large enough to run in parallel on two threads
        seen.append(torch.get_num_threads())
        done.set()

    thread = host_threads.start(work, "helper", 1)
    done.wait()
    thread.join()
    assert seen == [1]
    assert torch.get_num_threads() == 2  # the caller's
    assert _count_in_new_thread() == 2  # what a thread started later takes


def test_a_helper_keeps_every_thread_where_asked(two_threads) -> None:
    seen: list[int] = []
    host_threads.start(lambda: seen.append(torch.get_num_threads()), "helper", None).join()
    assert seen == [2]


def test_a_helper_runs_on_the_count_it_is_given_and_changes_no_other_threads_count(two_threads) -> None:
    seen: list[int] = []
    host_threads.start(lambda: seen.append(torch.get_num_threads()), "helper", 3).join()
    assert seen == [3]
    assert torch.get_num_threads() == 2 and _count_in_new_thread() == 2


def test_a_ranks_helper_takes_its_share_of_the_node() -> None:
    share = host_threads.helper_threads
    # A CPU device: the compute thread owns the cores, whatever the launch.
    assert share(False, 1, {}) == 1 and share(False, 8, {"OMP_NUM_THREADS": "16"}) == 1
    # One process on a GPU: the process's count (OMP_NUM_THREADS or torch's default), as before.
    assert share(True, 1, {}, affinity=64, cpu_count=64, physical=64) is None
    # torchrun --nproc-per-node 8 on 64 unbound cores set OMP_NUM_THREADS=1: each rank takes 64 / 8.
    assert share(True, 8, {"OMP_NUM_THREADS": "1"}, affinity=64, cpu_count=64, physical=64) == 8
    assert share(True, 8, {}, affinity=64, cpu_count=64, physical=64) == 8  # another launcher: not 8 x 64
    assert share(True, 3, {}, affinity=16, cpu_count=16, physical=16) == 5
    assert share(True, 32, {}, affinity=16, cpu_count=16, physical=16) == 1
    # Two hardware threads a core: the physical cores are shared, as torch counts them for one process.
    assert share(True, 8, {"OMP_NUM_THREADS": "1"}, affinity=128, cpu_count=128, physical=64) == 8
    # A launcher bound the rank to its NUMA node's 32 CPUs (16 cores with their second hardware threads).
    assert share(True, 8, {"OMP_NUM_THREADS": "1"}, affinity=32, cpu_count=128, physical=64) == 16
    assert share(True, 8, {"OMP_NUM_THREADS": "1"}, affinity=32, cpu_count=128, physical=128) == 32
    # A count the user chose is kept.
    assert share(True, 8, {"OMP_NUM_THREADS": "4"}, affinity=64, cpu_count=64, physical=64) is None


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts OS threads through /proc")
def test_a_cpu_engine_steps_without_an_openmp_team_beside_the_compute_threads(two_threads) -> None:
    """Every OS thread that appears while an Engine steps is a Python thread (the AdamW worker): its kernels (clip,
    fused AdamW) built no OpenMP team of their own, so the compute thread's kernels keep a spinning team."""
    before = set(os.listdir("/proc/self/task"))
    ids = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with Engine(TINY, optimizer=OptimizerConfig(lr=1e-3, max_grad_norm=1.0), plan=Plan(micro_batch_size=2),
                compute_dtype=torch.float32, device="cpu") as engine:
        for _ in range(2):
            engine.step(ids, ids)
        engine.synchronize()
        assert engine.step_count == 2
        new = set(os.listdir("/proc/self/task")) - before
        python = {str(t.native_id) for t in threading.enumerate()}
        assert new and new <= python, (new, python)  # the worker, and no OpenMP thread
    assert torch.get_num_threads() == 2
