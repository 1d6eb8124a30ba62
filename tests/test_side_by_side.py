"""The planner's work side by side (planner/choice/side_by_side.py): jobs forked to the cores give what they give in
turn, a worker never forks again, and a search dealt to two processes chooses the very plan it chooses in one."""
from __future__ import annotations

import json
import subprocess
import sys

from megatrain.planner.choice import side_by_side

SCRIPT = """
import dataclasses, json, multiprocessing, os
os.sched_getaffinity = lambda pid: {0, 1}  # two cores, whatever this machine has
from megatrain.planner.choice import search, side_by_side
from megatrain.planner.profiling import hardware
from megatrain.planner.shapes import model_shapes
from megatrain.planner.shapes.workload import Workload

# Each job waits for one in the other worker: an instant job could otherwise all six go to the worker that
# started first, and the test would depend on which process the machine ran sooner.
both = multiprocessing.Barrier(2)

def where():
    both.wait(30)
    return os.getpid(), side_by_side.workers(8)

pids = side_by_side.run_apart([(where, ()) for _ in range(6)])
model, hw = model_shapes.resolve("shape:Llama-3.1-8B"), hardware.resolve("RTX-4090")
work = Workload(1024, 2, "bfloat16", clipping=True, spill="auto", spill_dir="/nvme", spill_free_bytes=2 << 40)
hands = len(side_by_side.dealt(search.candidates(model, work, hw), search.CANDIDATES_APART))
apart = search.search(model, work, hw)
fit_apart, misfit_apart = search.feasible_choices(model, work, hw)
side_by_side.workers = lambda jobs: 1  # the same search in this process alone
alone = search.search(model, work, hw)
fit_alone, misfit_alone = search.feasible_choices(model, work, hw)
print(json.dumps({"parent": os.getpid(), "pids": [p for p, _ in pids], "inner": [w for _, w in pids],
                  "hands": hands, "same_best": apart == alone, "same_fit": fit_apart == fit_alone,
                  "same_misfit": misfit_apart == misfit_alone, "fit": len(fit_alone), "misfit": len(misfit_alone)}))
"""


def test_a_search_dealt_to_two_processes_is_the_search_in_one() -> None:
    # A fresh process (no other thread, so it may fork), told it has two cores.
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["parent"] not in out["pids"] and len(set(out["pids"])) == 2  # two forked workers ran the six jobs
    assert out["inner"] == [1] * 6  # inside a worker, its own jobs run in turn
    assert out["hands"] == 2
    # every candidate's plans, memory and time, in the candidates' order, and the chosen plan
    assert out["same_fit"] and out["same_misfit"] and out["same_best"], out
    assert out["fit"] > 0 and out["misfit"] > 0


def test_items_are_dealt_round_robin_with_their_indices(monkeypatch) -> None:
    monkeypatch.setattr(side_by_side, "workers", lambda jobs: min(jobs, 3))
    assert side_by_side.dealt("abcdefg", 2) == [[(0, "a"), (3, "d"), (6, "g")], [(1, "b"), (4, "e")],
                                                [(2, "c"), (5, "f")]]
    assert side_by_side.dealt("abcdefg", 3) == [[(0, "a"), (2, "c"), (4, "e"), (6, "g")],
                                                [(1, "b"), (3, "d"), (5, "f")]]  # 7 // 3: two hands
    assert side_by_side.dealt("abc", 64) == [[(0, "a"), (1, "b"), (2, "c")]]  # too few for two hands


def test_jobs_run_in_turn_where_this_process_has_another_thread(monkeypatch) -> None:
    monkeypatch.setattr(side_by_side.threading, "active_count", lambda: 2)
    assert side_by_side.workers(8) == 1
    assert side_by_side.run_apart([(pow, (2, 5)), (pow, (3, 2))]) == [32, 9]
