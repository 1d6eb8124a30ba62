"""megatrain-plan's answers include the NVMe tier: size, the overview and plan --spill (in-process)."""
from __future__ import annotations

import collections
import json
import shutil

import pytest

from megatrain.planner.commands import cli
from megatrain.planner.shapes import model_shapes
from megatrain.planner.choice import search, sizing
from megatrain.planner.profiling.hardware import GiB, HardwareProfile
from megatrain.planner.shapes.workload import Workload
from plan_pages import pages

# A 24 GiB, 2-core CPU machine as `megatrain-plan profile` measures one: fp32 matmul far faster than bf16,
# disk not measured.
CPU_24G = HardwareProfile(
    gpu_name="cpu", gpu_mem_bytes=0, h2d_gbps=5.0, d2h_gbps=5.0, duplex_gbps=5.0,
    matmul_tflops={"float32": 0.05, "bfloat16": 0.0005}, cpu_adam_params_per_s=0.6e9, host_ram_bytes=24 * GiB,
    host_available_bytes=22 * GiB, cores=2, interconnect="none", source="fixed test profile")
FREE = 60 * GiB


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_size_reports_the_nvme_of_every_answer(capsys, monkeypatch) -> None:
    r = pages(monkeypatch, capsys, "size", "--model", "shape:Llama-3.1-8B", "--seq-len", "4096", "--batch", "8",
              "--json")
    assert r.rc == 0, r.err
    data = r.data
    n = data["params"]
    # fp32 master + AdamW m, v take 12 bytes/param; they live in RAM or on the NVMe, never nowhere.
    assert data["host_ram_bytes"] + data["nvme_bytes"] >= 12 * n
    assert data["nvme_bytes"] > 0 and data["spill"] != "none"          # the minimum-RAM answer spills...
    assert data["disk_traffic_bytes_per_step"] == 2 * data["nvme_bytes"]
    assert data["host_ram_no_spill_bytes"] >= 12 * n > data["host_ram_bytes"]   # ...and says what RAM alone needs
    rows = [e for e in data["hardware"] if e["feasible"]]
    assert len(rows) == len(data["hardware"])
    for e in rows:
        assert e["host_ram_bytes"] + e["nvme_bytes"] >= 12 * n, e["hardware"]
        assert e["host_ram_bytes"] <= e["host_ram_available_bytes"]
    assert any(e["nvme_bytes"] > 0 for e in rows)     # a 128 GiB workstation spills
    assert "on NVMe" in r.text and "without NVMe" in r.text and "issue #" not in r.text


def test_overview_on_a_24g_cpu_machine_trains_with_spill(capsys, monkeypatch, tmp_path) -> None:
    profile = tmp_path / "hw.json"
    CPU_24G.save(str(profile))
    _free_disk(monkeypatch, FREE)
    monkeypatch.chdir(tmp_path)
    r = pages(monkeypatch, capsys, "--hardware", str(profile), "--json")
    assert r.rc == 0, r.err
    data = r.data
    assert data["compute_dtype"] == "float32"         # bf16 matmul is 100x slower on this CPU
    assert data["disk"] == {"spill_dir": str(tmp_path), "free_bytes": FREE, "read_gbps": sizing.ASSUMED_DISK_GBPS,
                            "write_gbps": sizing.ASSUMED_DISK_GBPS, "speed_measured": False}
    models = {e["model"]: e for e in data["models"]}
    one_b = models["shape:Llama-3.2-1B"]
    assert one_b["fits"] == "spill" and 0 < one_b["nvme_bytes"] <= FREE and one_b["tokens_per_second"] > 0
    assert one_b["spill_cost_seconds"] > 0
    assert not search.fits(model_shapes.PRESETS["shape:Llama-3.2-1B"],
                           Workload(4096, 1, "fp32", spill="none"), CPU_24G)   # RAM alone cannot
    # Every model's answer agrees with the least memory any plan of it needs at batch 1.
    hw, _ = sizing.with_disk(CPU_24G)
    for name in ("shape:Llama-3.2-3B", "shape:Llama-3.1-8B"):
        least = search.minimum_memory(model_shapes.PRESETS[name],
                                      Workload(4096, 1, "fp32", spill_dir=str(tmp_path), spill_free_bytes=FREE), hw)
        mem = least["host"].memory
        fits = mem.device_bytes + mem.host_bytes <= CPU_24G.host_budget_bytes and mem.nvme_bytes <= FREE
        assert (models[name]["fits"] != "no") == fits, name
        if not fits:  # spill buffers are chunk-bounded: RAM or the disk's free space is what runs out
            assert "host RAM" in models[name]["reason"] or "NVMe" in models[name]["reason"]
    assert data["largest_model"] in models and models[data["largest_model"]]["feasible"]
    out = r.text
    assert "with spill" in out and "60.0 GiB free" in out and "assumed" in out and "float32" in out
    # No GPU: no PCIe figures, no bare "none"; figures not measured say so and name the command that measures them.
    first = out.splitlines()[0]
    assert "H2D" not in first and not first.endswith("; none")
    assert "these figures are rough guesses for this CPU, not measured: `megatrain-plan profile`" in out


def test_overview_without_a_gpu_plans_in_the_dtype_training_would_use(capsys, monkeypatch, tmp_path) -> None:
    # A CPU whose bf16 matmul is as fast as fp32: megatrain-train --compute-dtype auto still trains in fp32 there.
    profile = tmp_path / "hw.json"
    CPU_24G.replace(matmul_tflops={"float32": 0.05, "bfloat16": 0.05}).save(str(profile))
    _free_disk(monkeypatch, FREE)
    monkeypatch.chdir(tmp_path)
    rc, out, err = _main(capsys, "--hardware", str(profile), "--batch", "1", "--json")
    assert rc == 0, err
    assert json.loads(out)["compute_dtype"] == "float32"


def _free_disk(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(free + GiB, GiB, free))


def test_plan_spill_is_honoured_or_refused_with_the_fix(capsys, monkeypatch, tmp_path) -> None:
    args = ("plan", "--model", "shape:Llama-3.1-8B", "--seq-len", "1024", "--batch", "4", "--hardware", "RTX-4090")
    _free_disk(monkeypatch, 1 << 40)
    for spill in ("optimizer", "all"):
        rc, out, err = _main(capsys, *args, "--spill", spill, "--spill-dir", str(tmp_path), "--json")
        assert rc == 0, err
        data = json.loads(out)
        assert data["spill"] == data["plan"]["spill"] == spill and data["plan"]["spill_dir"] == str(tmp_path)
        assert data["nvme_bytes"] > 0 and data["disk"]["free_bytes"] == 1 << 40
    _free_disk(monkeypatch, 10 * GiB)     # too small for 8B's AdamW state
    rc, out, err = _main(capsys, *args, "--spill", "optimizer", "--spill-dir", str(tmp_path))
    assert rc == 2 and "NVMe: needs" in err and "more free space" in err
    # auto, too little RAM without spilling and too little disk with it: the refusal names both routes.
    rc, out, err = _main(capsys, *args, "--ram", "48G", "--spill-dir", str(tmp_path))
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "no plan fits: host RAM: needs" in err and "; spilling to disk instead: NVMe: needs" in err, err
    assert "has 10.00 GiB" in err and "more free space" in err
    _free_disk(monkeypatch, FREE)
    profile = tmp_path / "hw.json"
    CPU_24G.save(str(profile))
    rc, out, err = _main(capsys, "plan", "--model", "shape:Llama-3.2-1B", "--seq-len", "1024", "--batch", "1",
                         "--hardware", str(profile), "--spill", "all", "--spill-dir", str(tmp_path))
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "--nvme" in err and "profile --spill-dir" in err
    rc, out, err = _main(capsys, "plan", "--model", "shape:Llama-3.2-1B", "--seq-len", "1024", "--batch", "1",
                         "--hardware", str(profile), "--spill", "all", "--spill-dir", str(tmp_path), "--nvme", "2",
                         "--json")
    assert rc == 0, err
    assert json.loads(out)["spill"] == "all"
    # auto without --spill-dir spills nothing, and an infeasible answer says how spilling would help.
    rc, out, err = _main(capsys, *args, "--ram", "48G")
    assert rc == 2 and "--spill-dir" in err and len(err.strip().splitlines()) == 1
    # Spilling moves host state only: a GPU too small for any plan is not offered the disk.
    rc, out, err = _main(capsys, "plan", "--model", "shape:Llama-3.1-8B", "--seq-len", "1024", "--batch", "4",
                         "--hardware", "H200", "--gpu-mem", "1G")
    assert rc == 2 and "no plan fits: gpu memory: needs" in err and "host RAM" not in err and "spill" not in err


def test_plan_out_carries_its_workload(capsys, tmp_path) -> None:
    out_path = tmp_path / "plan.json"
    rc, out, err = _main(capsys, "plan", "--model", "shape:Llama-3.2-1B", "--seq-len", "2048", "--batch", "8",
                         "--hardware", "H100-SXM", "--out", str(out_path))
    assert rc == 0, err
    w = json.loads(out_path.read_text())["workload"]
    assert (w["model"], w["seq_len"], w["batch"], w["compute_dtype"]) == ("shape:Llama-3.2-1B", 2048, 8, "bfloat16")


def test_profile_refuses_an_unwritable_destination_before_measuring(capsys, tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, out, err = _main(capsys, "profile", "--out", str(blocker / "hw.json"))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--out" in err
    assert "measuring" not in err and blocker.read_text() == "x"
    rc, out, err = _main(capsys, "profile", "--out", str(tmp_path))
    assert rc == 2 and "is a directory" in err


def test_ram_answers_the_least_ram_of_its_ladder_and_size_agrees(capsys, monkeypatch) -> None:
    # An 8B model at 8 x 1024 on an RTX 4090: without NVMe it needs over 100 GiB; with the NVMe 64 GiB reaches
    # 200 tokens/s. ram's answer is never more than the smallest RAM size of its own table that reaches the target,
    # and size, given that RAM and batch, finds a plan as fast.
    common = ("--model", "shape:Llama-3.1-8B", "--hardware", "RTX-4090", "--seq-len", "1024")
    rc, out, err = _main(capsys, "ram", *common, "--tokens-per-second", "200", "--max-batch", "8", "--json")
    assert rc == 0, err
    data = json.loads(out)
    meeting = [e for e in data["ladder"] if e.get("tokens_per_second", 0) >= 200]
    assert data["reachable"] and meeting
    assert data["ram_to_buy_bytes"] <= min(e["ram_bytes"] for e in meeting)
    assert data["with_nvme"]["ram_to_buy_bytes"] < data["without_nvme"]["ram_to_buy_bytes"]  # the NVMe saves RAM
    assert data["nvme_bytes"] > 0 and data["tokens_per_second"] >= 200
    # without the NVMe: the least RAM of the rows without it that reach the target, or less
    plain = [e for e in meeting if not e["nvme"]]
    assert plain and data["without_nvme"]["ram_to_buy_bytes"] <= min(e["ram_bytes"] for e in plain)
    ram = f"{data['ram_to_buy_bytes'] // GiB}G"
    r = pages(monkeypatch, capsys, "size", *common, "--batch", str(data["batch"]), "--ram", ram, "--json")
    assert r.rc == 0, r.err
    (row,) = r.data["hardware"]
    assert row["feasible"] and row["tokens_per_second"] >= 200 and row["host_ram_bytes"] <= data["ram_to_buy_bytes"]
    out = r.text
    assert "<nvme>" not in out
    assert out.splitlines()[1].startswith("RTX-4090: fits with ") and " on NVMe: the run needs " in out


def _size_rate(capsys, common: tuple[str, ...], *more: str) -> float:
    """size's predicted tokens/s for one GPU preset (0 when nothing fits)."""
    rc, out, err = _main(capsys, "size", *common, *more, "--json")
    assert rc == 0, err
    (row,) = json.loads(out)["hardware"]
    return row["tokens_per_second"] if row["feasible"] else 0.0


def test_ram_answers_are_the_least_that_size_finds_meeting_the_target(capsys) -> None:
    # The least RAM ram names meets the target when size is asked with it and the same batch, and one step less
    # does not: with the NVMe one RAM size of its table less (it answers at the table's sizes), without it 32 GiB
    # less with nothing spilled.
    common = ("--model", "shape:Llama-3.1-8B", "--hardware", "RTX-4090", "--seq-len", "1024")
    target = 300
    rc, out, err = _main(capsys, "ram", *common, "--tokens-per-second", str(target), "--max-batch", "8", "--json")
    assert rc == 0, err
    data = json.loads(out)
    nvme, plain = data["with_nvme"], data["without_nvme"]
    rungs = sorted({e["ram_bytes"] for e in data["ladder"]})
    assert nvme["ram_to_buy_bytes"] in rungs and rungs.index(nvme["ram_to_buy_bytes"]) > 0
    below = rungs[rungs.index(nvme["ram_to_buy_bytes"]) - 1]
    batch = ("--batch", str(nvme["batch"]))
    assert _size_rate(capsys, common, *batch, "--ram", f"{nvme['ram_to_buy_bytes'] // GiB}G") >= target
    assert 0 < _size_rate(capsys, common, *batch, "--ram", f"{below // GiB}G") < target
    batch = ("--batch", str(plain["batch"]), "--spill", "none")
    assert _size_rate(capsys, common, *batch, "--ram", f"{plain['ram_to_buy_bytes'] // GiB}G") >= target
    assert _size_rate(capsys, common, *batch, "--ram", f"{plain['ram_to_buy_bytes'] // GiB - 32}G") < target


def test_size_says_what_does_not_fit_and_what_would(capsys, monkeypatch) -> None:
    r = pages(monkeypatch, capsys, "size", "--model", "shape:Llama-3.1-70B", "--hardware", "RTX-4090", "--ram", "64G")
    assert r.rc == 0, r.err
    verdict = r.text.splitlines()[1]
    assert verdict.startswith("RTX-4090: does not fit (host RAM") and "it would fit with at least " in verdict
    need = r.data["host_ram_bytes"]
    named = float(verdict.split("it would fit with at least ")[1].split(" GiB")[0].replace(",", ""))
    assert named * GiB >= need / 0.94  # the RAM to install covers what the run needs at the usable share


SIDE_BY_SIDE = """
import concurrent.futures, dataclasses, json, os, sys
from megatrain.planner.choice import ram_answers, side_by_side, sizing
from megatrain.planner.profiling import hardware
from megatrain.planner.shapes import model_shapes
from megatrain.planner.shapes.workload import Workload

pools = []
class Counted(concurrent.futures.ProcessPoolExecutor):
    def __init__(self, *a, **k):
        pools.append(a[0] if a else k.get("max_workers"))
        super().__init__(*a, **k)
side_by_side.concurrent.futures.ProcessPoolExecutor = Counted
os.sched_getaffinity = lambda pid: {0, 1}  # two cores, whatever this machine has
model, hw = model_shapes.resolve("shape:Llama-3.2-1B"), hardware.resolve("RTX-4090")
work = Workload(1024, 1, "bfloat16", clipping=True, spill="auto", spill_dir="/nvme", spill_free_bytes=2 << 40)
ladder, answer = ram_answers.ram_answers(model, work, hw, 8, 9000.0)
ram_pools = list(pools)  # the rows' one pool: a search inside a row's worker runs its candidates in turn
in_turn = sizing.ram_ladder(model, work, hw, 8)
expected = sizing.least_ram_for(model, work, hw, 9000.0, 8, None, in_turn)
print(json.dumps({"pools": ram_pools, "same_ladder": ladder == in_turn, "same_answer": answer == expected,
                  "rows": len(ladder), "reachable": answer.reachable}))
"""


def test_rams_searches_side_by_side_give_the_ladder_and_answer_searched_in_turn() -> None:
    # In a fresh process (no other thread, so run_apart forks): the rows and the answer searched in two forked
    # processes equal those searched one after another, compared as whole objects (every plan and figure).
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", SIDE_BY_SIDE], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["pools"] == [2]
    assert out["same_ladder"] and out["same_answer"] and out["rows"] == 2 * len(sizing.RAM_LADDER), out
