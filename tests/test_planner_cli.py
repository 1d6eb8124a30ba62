"""megatrain-plan as a user runs it: each subcommand, --json, and each bad input (one line, exit 2)."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from megatrain.planner.costs import cost_model, memory_model
from megatrain.planner.profiling import hardware
from megatrain.planner.shapes import model_shapes
from megatrain.planner.commands import plan as plan_command
from megatrain.planner.choice.plan_request import PlanRequest, choose_plan
from megatrain.planner.choice.search import PlanChoice
from megatrain.planner.shapes.workload import Workload
from megatrain.plan.plan import Plan
from plan_pages import pages

KEYS = {"params", "gpu_bytes", "host_ram_bytes", "nvme_bytes", "step_seconds", "tokens_per_second"}


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "megatrain.planner.commands.cli", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_plan_json_and_out(tmp_path) -> None:
    out = tmp_path / "plan.json"
    r = run("plan", "--model", "shape:Qwen2.5-7B", "--seq-len", "1024", "--batch", "158", "--hardware", "H100-SXM",
            "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert KEYS <= set(data)
    assert data["params"] == 7_615_616_512
    assert data["nvme_bytes"] == 0
    assert 0 < data["gpu_bytes"] <= 81559 * 2**20
    plan = Plan.load(str(out))
    assert plan.to_dict() == data["plan"]
    assert sum(row["bytes"] for row in data["memory"] if row["where"] == "device") == data["gpu_bytes"]


def test_plan_table_shows_memory_time_and_bottleneck() -> None:
    r = run("plan", "--model", "shape:Llama-3.2-1B", "--seq-len", "2048", "--tokens-per-step", "16384", "--hardware",
            "L40S",
            "--ram", "256G", "--no-clip")
    assert r.returncode == 0, r.stderr
    for word in ("weight slots", "fp32 master", "TOTAL", "forward", "backward", "bottleneck", "8 x 2048"):
        assert word in r.stdout, word


def test_plan_says_what_clipping_costs_where_adamw_bounds_the_step() -> None:
    """1B, 16 x 2048 tokens on an H200 with a 16-core workstation host, clipping on: the search keeps every block's
    optimizer state on the GPU, so the CPU AdamW no longer bounds the step and the page has no clipping note. With
    that state in host RAM every update waits for backward's end and the CPU AdamW bounds the step; there
    ``clipping_cost`` gives the step without clipping (the same search, eager updates), faster."""
    args = ("plan", "--model", "shape:Llama-3.2-1B", "--seq-len", "2048", "--batch", "16", "--hardware", "H200",
            "--host", "workstation-128g")
    data = json.loads(run(*args, "--json").stdout)
    assert data["time"]["bottleneck"] == "compute" and len(data["plan"]["resident_blocks"]) == 18
    assert "without_clipping" not in data
    model, hw, work = model_shapes.resolve("shape:Llama-3.2-1B"), hardware.resolve("H200", "workstation-128g"), \
        Workload(2048, 16)
    chosen = choose_plan(model, PlanRequest(work), hw)
    host = chosen.plan.replace(resident_blocks=())
    cost = cost_model.estimate(model, work, host, hw)
    assert cost.bottleneck == "CPU AdamW"
    on_host = dataclasses.replace(chosen, choice=PlanChoice(host, memory_model.estimate(model, work, host, hw), cost))
    unclipped = plan_command.clipping_cost(model, work, on_host, None)
    assert unclipped is not None and unclipped.step_seconds < cost.step_seconds
    assert unclipped.step_seconds == pytest.approx(json.loads(run(*args, "--no-clip", "--json").stdout)["step_seconds"])


def test_plan_with_config_json(tmp_path) -> None:
    cfg = {"model_type": "qwen3", "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 4,
           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 5000,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    r = run("plan", "--model", str(path), "--seq-len", "512", "--batch", "4", "--hardware", "RTX-3090", "--json")
    assert r.returncode == 0, r.stderr
    assert KEYS <= set(json.loads(r.stdout))


def test_size_json(monkeypatch, capsys) -> None:
    r = pages(monkeypatch, capsys, "size", "--model", "shape:Llama-3.1-8B", "--seq-len", "4096", "--batch", "16",
              "--json", "--spill", "none")
    assert r.rc == 0, r.err
    assert KEYS <= set(r.data)
    assert {e["hardware"] for e in r.data["hardware"]} >= {"H100-SXM", "RTX-3090"}
    assert any(not e["feasible"] and "host RAM" in e["reason"] for e in r.data["hardware"])
    assert "minimum GPU memory" in r.text and "H200" in r.text


def test_ram_json_and_table() -> None:
    r = run("ram", "--model", "shape:Qwen2.5-7B", "--tokens-per-second", "5000", "--hardware", "H100-SXM",
            "--price-per-gb", "3", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["reachable"] and data["tokens_per_second"] >= 5000
    assert data["ram_to_buy_bytes"] >= data["host_ram_bytes"]
    assert data["ram_cost"] == pytest.approx(data["ram_to_buy_bytes"] / 1e9 * 3)
    assert data["nvme_to_buy_bytes"] == data["nvme_bytes"]
    # The ladder: every RAM size, without and with the NVMe; more RAM never fits a smaller batch.
    ladder = data["ladder"]
    assert len(ladder) == 12 and {e["nvme"] for e in ladder} == {False, True}
    for nvme in (False, True):
        rows = sorted((e for e in ladder if e["nvme"] == nvme), key=lambda e: e["ram_bytes"])
        assert [e["ram_bytes"] // 2**30 for e in rows] == [64, 128, 256, 512, 1024, 2048]
        assert [e["batch"] for e in rows] == sorted(e["batch"] for e in rows)
        for e in rows:
            if e["batch"]:
                assert e["host_ram_bytes"] <= 0.94 * e["ram_bytes"]
                assert (e["nvme_bytes"] > 0) == (e["spill"] != "none") and (e["spill"] == "none" or nvme)
                assert e["nvme_bytes"] <= data["nvme"]["size_bytes"]
    # With an NVMe, the smallest RAM size fits at least what it fits without.
    small = [e for e in ladder if e["ram_bytes"] == 64 * 2**30]
    assert max(e["batch"] for e in small if e["nvme"]) >= max(e["batch"] for e in small if not e["nvme"])
    assert not data["price_assumed"] and data["price_per_gb"] == 3


def test_ram_out_of_reach_names_the_best_and_its_bound(monkeypatch, capsys) -> None:
    r = pages(monkeypatch, capsys, "ram", "--model", "shape:Qwen2.5-7B", "--tokens-per-second", "1e9", "--hardware",
              "RTX-3090", "--max-batch", "16", "--json")
    assert r.rc == 0, r.err
    assert not r.data["reachable"] and 0 < r.data["best_tokens_per_second"] < 1e9
    assert r.data["bound_by"]
    assert "out of reach" in r.text and "the best is" in r.text and "bound by" in r.text
    assert not re.search(r"at most [0-9,]+ tok/s", r.text)


def test_overview_with_a_preset_and_json(monkeypatch, capsys) -> None:
    """Every preset model on a 24 GB GPU: some train from RAM, some spill, some do not fit at all."""
    r = pages(monkeypatch, capsys, "--hardware", "RTX-4090", "--json")
    assert r.rc == 0, r.err
    data = r.data
    assert sorted(e["model"] for e in data["models"]) == sorted(model_shapes.PRESETS)  # every preset, once each
    assert data["largest_model"] is not None and data["longest_context"]["seq_len"] > 0
    assert data["compute_dtype"] == "bfloat16"
    for e in data["models"]:
        assert e["fits"] in ("ram", "spill", "no") and (e["fits"] == "no") == (not e["feasible"])
        if e["feasible"]:
            assert (e["nvme_bytes"] > 0) == (e["fits"] == "spill") and e["batch"] in (1, 2, 4, 8, 16)
    assert {e["fits"] for e in data["models"]} == {"ram", "spill", "no"}
    assert "largest model it can train" in r.text


def test_overview_detects_this_machine(tmp_path) -> None:
    # No saved profile: detect (no benchmarks) and still answer.
    r = run(env={"MEGATRAIN_HARDWARE": str(tmp_path / "none.json"), "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "this machine" in r.stdout


def test_profile_writes_a_profile(tmp_path) -> None:
    """The command saves the profile where asked and a plan is made from it (the disk: ``--disk-only``'s test)."""
    out = tmp_path / "hw.json"
    r = run("profile", "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["saved_to"] == str(out)
    r = run("plan", "--model", "shape:Qwen2.5-0.5B", "--seq-len", "128", "--batch", "2", "--hardware", str(out),
            "--ram", "16G", "--json")  # RAM fixed: what is free at the moment must not decide the test
    assert r.returncode == 0, r.stderr


def _small_disk_probe(monkeypatch) -> None:
    """The disk probe's own code at a test's size: 32 MiB a pass in 4 MiB requests, and the CPU it costs in 0.2 s
    phases (the command: 1 GiB in 64 MiB requests and 2 s phases, most of the 23 s this test took as a subprocess)."""
    from megatrain.planner.profiling import disk_contention, disk_profile
    from megatrain.planner.profiling.hardware import GiB

    bandwidth, contention, request = disk_profile.disk_bandwidth, disk_contention.cpu_seconds_per_gb, 4 << 20

    def small_bandwidth(directory, nbytes, **kw):
        assert nbytes == 1 * GiB  # what the command measures
        return bandwidth(directory, 32 << 20, request=request, **kw)

    monkeypatch.setattr(disk_profile, "disk_bandwidth", small_bandwidth)
    monkeypatch.setattr(disk_contention, "cpu_seconds_per_gb", lambda directory, direct, work: contention(
        directory, direct, work, seconds=0.2, request=request, file_bytes=8 * request))


def test_profile_disk_only_measures_the_disk_into_the_saved_profile_and_keeps_the_rest(tmp_path, monkeypatch,
                                                                                      capsys) -> None:
    """--disk-only: the saved profile's disk figures measured again, its source saying where and when (once, however
    often it runs), every other figure and the calibration as they were; without a saved profile or a disk to
    measure, one line naming the fix, and the file untouched. The measuring run in-process, at a small size."""
    from megatrain.planner.commands import cli
    from megatrain.planner.profiling import disk_profile
    from megatrain.planner.profiling.calibration import Calibration
    from megatrain.planner.profiling.hardware import HardwareProfile

    cal = Calibration(compute_dtype="fp32", tflops_by_width=((256, 0.02),), block_overhead_s=0.001,
                      adam_params_per_s=1e9, h2d_gbps=5.0, d2h_gbps=5.0, process_bytes=300_000_000,
                      temporaries_bytes=0, temporaries_factor=1.0, source="a test")
    saved = HardwareProfile(gpu_name="cpu", gpu_mem_bytes=0, h2d_gbps=5.0, d2h_gbps=5.0, duplex_gbps=5.0,
                            matmul_tflops={"float32": 0.123}, cpu_adam_params_per_s=4.56e8, host_ram_bytes=8 << 30,
                            host_available_bytes=6 << 30, cores=2, disk_read_gbps=0.001, disk_write_gbps=0.002,
                            source="measured by a test; disk not measured (pass --spill-dir)", calibrations=(cal,))
    out = tmp_path / "hw.json"
    saved.save(str(out))
    out.chmod(0o640)
    spill = tmp_path / "spill"
    spill.mkdir()
    _small_disk_probe(monkeypatch)
    assert cli.main(["profile", "--disk-only", "--spill-dir", str(spill), "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["saved_to"] == str(out)
    now = HardwareProfile.load(str(out))
    again = disk_profile.with_disk_measured(now, {"disk_read_gbps": 1.0}, "/elsewhere")
    assert again.source.count("disk re-measured") == 1 and again.source.startswith("measured by a test; ")
    assert again.source.split("; ")[-1].startswith("disk re-measured in /elsewhere on ")
    assert again.disk_read_gbps == 1.0 and again.calibrations == (cal,)
    assert now.disk_read_gbps > 0.001 and now.disk_write_gbps > 0.002 and now.disk_direct_faster is not None
    assert now.replace(disk_read_gbps=0.001, disk_write_gbps=0.002, disk_direct_faster=None, disk_cpu_s_per_gb=0.0,
                       source=saved.source) == saved  # the rest and the calibration as saved
    assert now.source.startswith("measured by a test; disk re-measured in " + str(spill))
    assert now.source.count("disk re-measured") == 1 and "disk not measured" not in now.source
    assert sorted(os.listdir(tmp_path)) == ["hw.json", "spill"] and os.listdir(spill) == []
    assert out.stat().st_mode & 0o777 == 0o640  # replaced whole, its mode kept
    before = out.read_bytes()
    for args, needle in ((("--out", str(tmp_path / "none.json"), "--spill-dir", str(spill)), "there is none at"),
                         (("--out", str(out)), "--spill-dir DIR")):
        r = run("profile", "--disk-only", *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr, r.stderr
    (tmp_path / "bad.json").write_text("{not json")
    r = run("profile", "--disk-only", "--spill-dir", str(spill), "--out", str(tmp_path / "bad.json"))
    assert r.returncode == 2 and "cannot read the profile" in r.stderr and "Traceback" not in r.stderr
    assert out.read_bytes() == before and not (tmp_path / "none.json").exists()


@pytest.mark.parametrize("args, needle", [
    (("plan", "--model", "GPT-5", "--seq-len", "1024", "--batch", "1", "--hardware", "H100-SXM"), "shape:Llama-3.1-8B"),
    (("plan", "--model", "shape:Qwen2.5-7B", "--seq-len", "1024", "--batch", "1", "--hardware", "B200"), "H100-SXM"),
    (("size", "--model", "shape:Qwen2.5-7B", "--seq-len", "1024", "--batch", "1", "--host", "tiny"), "server-1t"),
    (("plan", "--model", "shape:Llama-3.1-405B", "--seq-len", "4096", "--batch", "8", "--hardware", "RTX-4090"),
     "gpu memory"),
    (("plan", "--model", "shape:Llama-3.1-8B", "--seq-len", "1024", "--batch", "1", "--hardware", "H100-SXM",
      "--ram", "16G"), "host RAM"),
    (("plan", "--model", "shape:Qwen2.5-7B", "--seq-len", "1024", "--batch", "1", "--ram", "lots"), "512G"),
    (("plan", "--model", "shape:Qwen2.5-7B", "--seq-len", "0", "--batch", "1"), "--seq-len"),
    (("plan", "--model", "shape:Qwen2.5-7B", "--seq-len", "64", "--batch", "1", "--dtype", "int4"), "bf16"),
    (("frobnicate",), "plan"),
    (("profile", "--spill-dir", "/nonexistent/dir"), "--spill-dir"),
    (("plan", "--model", "shape:Llama-3.1-8B", "--seq-len", "1024", "--batch", "1", "--hardware", "H100-SXM",
      "--spill", "all"), "--spill-dir"),
    (("plan", "--model", "shape:Llama-3.1-8B", "--seq-len", "1024", "--batch", "1", "--hardware", "H100-SXM",
      "--spill-d", "/tmp"), "unrecognized arguments: --spill-d"),
    (("plan", "--model", "shape:Llama-3.1-8B", "--seq-len", "1024", "--bat", "1"),
     "--batch --tokens-per-step is required"),
    (("size", "--model", "shape:Llama-3.1-8B", "--seq-len", "1024", "--bat", "1"), "unrecognized arguments: --bat"),
    (("ram", "--model", "shape:Llama-3.1-8B", "--nvme-size", "huge"), "--nvme-size"),
    (("plan", "--model", "Qwen2.5-7B", "--seq-len", "1024", "--batch", "1"), "is now shape:Qwen2.5-7B (the published "
                                                                              "shape with random weights"),
])
def test_bad_input_is_one_line_exit_2(args: tuple[str, ...], needle: str) -> None:
    r = run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr and needle in lines[0], lines[0]


def test_malformed_config_json(tmp_path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": 4096,')
    r = run("plan", "--model", str(bad), "--seq-len", "1024", "--batch", "1", "--hardware", "H100-SXM")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "not valid JSON" in r.stderr
    bad.write_text('{"model_type": "llama"}')
    r = run("plan", "--model", str(bad), "--seq-len", "1024", "--batch", "1", "--hardware", "H100-SXM")
    assert r.returncode == 2 and "hidden_size" in r.stderr
