"""benchmarks/peers.py on the CPU at a tiny size, and the pieces of its report.

The end-to-end test runs the real command: megatrain, PyTorch in memory and FSDP2 each
in its own subprocess from the same weights and batches (fp32 on a CPU, so their losses
agree to float32 noise), DeepSpeed recorded as not run; the JSON and Markdown are
written. No timing is asserted (benchmarks measure; tests check).
"""
from __future__ import annotations

import datetime
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from peer_runners import report  # noqa: E402
from peer_runners.child import status_of  # noqa: E402
from peer_runners.spec import RunSpec, model_config  # noqa: E402
from peer_runners.sweep import sweep_batch  # noqa: E402

RAN_HERE = ("megatrain", "pytorch", "fsdp2")

def tiny_shape():
    """The planner's ModelShape of the tiny peers model."""
    from peer_runners.weights import model_shape

    return model_shape(RunSpec(system="pytorch", model="tiny", config=model_config("tiny", None, 32), seq=32,
                               batch=4, micro_batch=2, steps=2))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("peers")
    out = tmp / "results"
    # lr 1e-2: large enough that a system that skipped its update would miss the 1e-4 agreement below.
    cmd = [sys.executable, str(ROOT / "benchmarks" / "peers.py"), "--model", "tiny", "--seq", "32", "--batch", "4",
           "--micro-batch", "2", "--steps", "2", "--lr", "1e-2", "--device", "cpu", "--out", str(out),
           "--logs", str(tmp / "logs")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [path] = out.glob("*_cpu_peers.json")
    return json.loads(path.read_text()), path, proc


def test_every_cpu_system_runs_and_agrees(tiny_run):
    rep, _, _ = tiny_run
    rows = {r["system"]: r for r in rep["runs"]}
    assert set(rows) == {"megatrain", "pytorch", "fsdp2", "deepspeed", "zero_offload"}
    shape = tiny_shape()
    for name in RAN_HERE:
        r = rows[name]
        assert r["status"] == "ok", (name, r["status"], r.get("log_tail"))
        assert r["tokens_per_second"] > 0 and r["model_tflops"] > 0 and r["mfu"] > 0
        assert len(r["losses"]) == 2 and len(r["step_seconds"]) == 2
        # One timed step after the warm-up: its median is itself; the tail step and the drain are apart.
        assert r["median_step_seconds"] == r["min_step_seconds"] == r["max_step_seconds"] == r["step_seconds"][1]
        assert r["timed_steps"] == 1 and r["steady_state"] is False
        assert r["tail_step_seconds"] > 0 and r["drain_seconds"] >= 0 and "tail_loss" in r
        # 6 x N_matmul per token; the every-parameter figure beside it; no datasheet peak for a CPU.
        tps = r["tokens_per_second"]
        assert r["model_tflops"] == pytest.approx(6 * shape.matmul_params_active * tps / 1e12)
        assert r["all_params_tflops"] == pytest.approx(6 * shape.params * tps / 1e12)
        assert r["mfu_datasheet"] is None and r["mfu"] == r["mfu_measured_matmul"]
        assert r["run_header"]["matmul_peak_tflops"] == rep["matmul_peak_tflops"]
        assert r["system_params"] == r["params"] and "params_mismatch" not in r
        assert r["loss_reference"] == "pytorch"
        # Same weights, same batches, fp32: the first loss (before any update) and the last agree.
        assert r["first_loss_rel_diff"] < 1e-5, (name, r["losses"], rows["pytorch"]["losses"])
        assert r["final_loss_rel_diff"] < 1e-4, (name, r["losses"], rows["pytorch"]["losses"])
        assert r["peak_host_rss_bytes"] > 0
    assert rows["deepspeed"]["status"] == "not run: needs CUDA"
    assert rows["zero_offload"]["status"] == "not run: needs CUDA"
    # The tiny model fits in memory without activation checkpointing: PyTorch runs without it.
    assert rows["pytorch"]["details"]["activation_checkpointing"].startswith("off (estimate")
    assert rows["fsdp2"]["details"]["reshard_after_forward"] == "layers True, root False"
    assert rows["fsdp2"]["details"]["gradient_sync"].startswith("last micro-batch only")
    assert rows["megatrain"]["details"]["planner"] == "best of the search"
    bd = rows["megatrain"]["breakdown_median"]
    assert bd["step_s"] > 0
    # One steady step (2 steps, 1 warm-up), so its median is that step's own roofline; the planner's CPU plan runs
    # AdamW on the compute thread, in series with compute.
    assert rows["megatrain"]["details"]["plan"]["adam_thread"] == "compute"
    assert bd["roofline_s"] == max(bd["compute_s"] + bd["adam_busy_s"], bd["h2d_busy_s"], bd["d2h_busy_s"])
    assert rows["megatrain"]["roofline_ratio"] == bd["roofline_ratio"] > 0
    assert rows["fsdp2"]["details"]["offload"].startswith("none")
    assert rep["machine"]["device"] == "cpu" and rep["matmul_peak_tflops"] > 0


def test_report_files_are_written(tiny_run):
    rep, path, proc = tiny_run
    md = path.with_suffix(".md").read_text()
    for name in ("megatrain", "pytorch", "fsdp2", "deepspeed", "not run: needs CUDA", "recompute", "N_matmul",
                 "Fewer than 5 timed steps"):
        assert name in md
    assert md in proc.stdout  # the table is also printed
    figure = rep["figure"]
    assert figure.startswith("skipped") or pathlib.Path(figure).is_file()


def test_sweep_batches_divide():
    assert sweep_batch(2048, 32768, 8192) == (16, 4)
    assert sweep_batch(8192, 32768, 8192) == (4, 1)
    assert sweep_batch(3000, 32768, 9000) == (10, 2)  # 3 does not divide 10: the micro-batch shrinks
    assert sweep_batch(65536, 32768, 8192) == (1, 1)


def test_failures_are_classified():
    class OutOfMemoryError(RuntimeError):
        pass

    s = status_of(OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), {"peak_gpu_bytes": 3 * 2**30})
    assert s.startswith("out of memory (GPU, peak 3.0 GiB)")
    assert status_of(ValueError("bad\nmore"), {}) == "failed: ValueError: bad"


def _row(system: str, status: str, final: float | None = None, micro: int = 2, seconds: float = 0.5,
         header: dict | None = None) -> dict:
    spec = RunSpec(system=system, model="tiny", config=model_config("tiny", None, 32), seq=32, batch=16,
                   micro_batch=micro, steps=2)
    raw = {"status": status}
    if final is not None:
        raw.update(step_seconds=[1.0, seconds], losses=[6.0, final])
    row = report.derive(spec, raw, tiny_shape(), peak_tflops=1.0)
    if header is not None:
        row["run_header"] = header
    return row


def test_derived_flops_follow_the_protocol():
    """6 x N_matmul x tokens / step (lm_head in, the input embedding out), attention by the model convention, MFU
    against the run's matmul peak and the datasheet's dense bf16 peak of a named device."""
    spec = RunSpec(system="pytorch", model="tiny", config=model_config("tiny", None, 32), seq=32, batch=4,
                   micro_batch=2, steps=7)
    raw = {"status": "ok", "step_seconds": [9.0, 0.5, 0.4, 0.6, 0.5, 0.7, 0.5], "losses": [6.0] * 7}
    row = report.derive(spec, raw, tiny_shape(), peak_tflops=700.0, gpu="NVIDIA H200")
    cfg = model_config("tiny", None, 32)
    h, i, v, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    n_matmul = L * (2 * h * h + 2 * h * kv_heads * d + 3 * h * i) + v * h
    tps = 4 * 32 / 0.5  # the median of the 6 steps after the warm-up
    assert row["median_step_seconds"] == 0.5 and row["min_step_seconds"] == 0.4 and row["max_step_seconds"] == 0.7
    assert row["timed_steps"] == 6 and row["steady_state"] is True
    assert row["matmul_params_active"] == n_matmul
    assert row["model_tflops"] == pytest.approx(6 * n_matmul * tps / 1e12)
    attention = L * 3 * 2 * heads * d * (32 + 1)  # causal forward 2 x heads x d x (S + 1), backward 2x forward
    assert row["attention_tflops"] == pytest.approx(attention * tps / 1e12)
    assert row["mfu"] == pytest.approx(row["model_tflops"] / 700.0)
    assert row["datasheet_peak"] == {"device": "H200 SXM", "bf16_dense_tflops": 989.5}
    assert row["mfu_datasheet"] == pytest.approx(row["model_tflops"] / 989.5)
    nvl = report.derive(spec, raw, tiny_shape(), peak_tflops=700.0, gpu="NVIDIA H100 NVL")
    assert nvl["datasheet_peak"]["device"] == "H100 NVL"


def test_deepspeed_runs_at_each_micro_batch_and_the_best_is_marked():
    from peer_runners.sweep import micro_batches

    assert micro_batches("deepspeed", 16, 2) == [4, 8, 16]
    assert micro_batches("deepspeed", 8, 2) == [4, 8]
    assert micro_batches("deepspeed", 6, 3) == [3]      # none of 4, 8, 16 divides 6: the peers' micro-batch
    assert micro_batches("pytorch", 16, 2) == [2]
    rows = [_row("pytorch", "ok", 5.0), _row("deepspeed", "ok", 5.0, micro=4, seconds=0.9),
            _row("deepspeed", "ok", 5.0, micro=8, seconds=0.6),
            _row("deepspeed", "out of memory (GPU, peak 79.0 GiB): ...", micro=16)]
    report.mark_best(rows)
    assert [r.get("best_of_sweep") for r in rows] == [None, False, True, False]


def test_merged_runs_keep_their_own_headers():
    """A report merging runs of two days states each run's machine and matmul peak, not one for all."""
    def machine(peak: float) -> dict:
        return {"device": "cpu", "cpu": "x", "cores": 2, "usable_cores": 2, "python": "3", "torch": "t",
                "matmul_peak": {"tflops": peak, "dtype": "float32", "n": 8}}

    day1 = report.run_header(machine(1.0), "2026-01-01", "peers.py --model tiny")
    day2 = report.run_header(machine(2.5), "2026-01-02", "peers.py --model tiny --resume")
    rows = [_row("megatrain", "ok", 5.0, header=day1), _row("pytorch", "ok", 5.0, header=day2)]
    rep = report.build(machine(2.5), "2026-01-02", {"warmup": 1}, rows)
    assert rep["run_headers"] == [day1, day2]
    md = report.markdown(rep)
    assert "merges runs measured on 2 machines or days" in md
    assert "r1: 2026-01-01" in md and "matmul peak **1.0 TFLOP/s**" in md and "matmul peak **2.5 TFLOP/s**" in md
    assert "| megatrain (r1) |" in md and "| pytorch (r2) |" in md


def test_loss_reference_falls_back_when_pytorch_did_not_run():
    rows = [_row("megatrain", "ok", 5.0), _row("pytorch", "out of memory (GPU, peak 79.0 GiB): ..."),
            _row("fsdp2", "ok", 5.5)]
    report.agree(rows)
    assert rows[0]["loss_reference"] == "megatrain" and rows[0]["final_loss_rel_diff"] == 0
    assert rows[2]["final_loss_rel_diff"] == pytest.approx(0.1)
    assert rows[0]["median_step_seconds"] == 0.5 and rows[0]["tokens_per_second"] == 16 * 32 / 0.5
    assert "final_loss_rel_diff" not in rows[1]
    machine = {"device": "cpu", "cpu": "x", "cores": 2, "usable_cores": 2, "python": "3", "torch": "t",
               "matmul_peak": {"tflops": 1.0, "dtype": "float32", "n": 8}}
    md = report.markdown(report.build(machine, "2026-01-01", {"warmup": 1}, rows))
    assert "| pytorch | 2 | out of memory (GPU, peak 79.0 GiB): ... |" in md


def test_resume_keeps_results_and_decides_again_what_did_not_run(tmp_path):
    """``--resume`` keeps the results of today's report (ok, out of memory, and failed unless retried) and decides
    again every run recorded as not run: DeepSpeed recorded as not installed on a GPU machine runs once it is; on a
    CPU it is recorded as not run again, at once, without a subprocess."""
    from peer_runners.sweep import Comparison

    machine = {"device": "cpu", "cpu": "x", "cores": 2, "usable_cores": 2, "python": "3", "torch": "t",
               "matmul_peak": {"tflops": 1.0, "dtype": "float32", "n": 8}}
    rows = [_row("megatrain", "ok", 5.0), _row("pytorch", "out of memory (GPU, peak 79.0 GiB): ..."),
            _row("fsdp2", "failed: ValueError: bad"),
            _row("deepspeed", "not run: not installed (pip install deepspeed)")]
    settings = {"steps": 2, "warmup": 1, "seed": 0, "lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                "weight_decay": 0.1, "max_grad_norm": 1.0}

    today = datetime.date.today().isoformat()
    report.write(report.build(machine, today, dict(settings), rows), str(tmp_path / f"{today}_cpu_peers"))

    def resumed(retry_failed: bool) -> Comparison:
        return Comparison(machine, str(tmp_path), str(tmp_path / "logs"), dict(settings), None, 60, resume=True,
                          retry_failed=retry_failed)

    c = resumed(False)
    assert [r["system"] for r in c.rows] == ["megatrain", "pytorch", "fsdp2"]
    # Rows written before rows carried their run's header are stamped with their report's.
    assert all(r["run_header"]["date"] == today and r["run_header"]["matmul_peak_tflops"] == 1.0 for r in c.rows)
    assert [r["system"] for r in resumed(True).rows] == ["megatrain", "pytorch"]
    row = c.run(c.spec("deepspeed", "tiny", None, 32, 4, 2))
    assert row["status"] == "not run: needs CUDA"
    assert [r["system"] for r in c.rows] == ["megatrain", "pytorch", "fsdp2", "deepspeed"]


def test_memory_estimates_by_hand_and_the_checkpointing_choice():
    """fits.py's estimates are the formulas its docstring states; PyTorch runs without checkpointing where that
    estimate fits 85% of the device (the 3B shape at 4 x 2048 on an H200's 139.8 GiB, not on an 80 GB H100)."""
    from types import SimpleNamespace

    from peer_runners import fits

    shape = SimpleNamespace(params=1000, params_layer=100, num_layers=4, layer_working_bytes_per_token=lambda c: 50,
                            logits_bytes_per_token=lambda c: 30, checkpoint_bytes_per_token=lambda c: 8)
    tokens = 16
    without = 18 * 1000 + 4 * 16 * 50 + 16 * 30
    with_ckpt = 18 * 1000 + 4 * 16 * 8 + 16 * 50 + 16 * 30
    assert fits.in_vram_bytes(shape, tokens, checkpointing=False) == without
    assert fits.in_vram_bytes(shape, tokens, checkpointing=True) == with_ckpt
    assert fits.zero_offload_bytes(shape, tokens) == with_ckpt - 14 * 1000
    assert fits.fsdp_no_sync_bytes(shape, tokens) == with_ckpt - 14 * 1000 + 2 * 100
    assert fits.choose_checkpointing(shape, tokens, int(without / 0.85) + 1)[0] is False
    assert fits.choose_checkpointing(shape, tokens, int(without / 0.85) - 1)[0] is True
    assert fits.choose_checkpointing(shape, tokens, None)[0] is False  # unknown memory: try, fall back on OOM

    from peer_runners.weights import model_shape

    spec3b = RunSpec(system="pytorch", model="3b", config=model_config("3b", None, 2048), seq=2048, batch=16,
                     micro_batch=4, steps=6)
    h200, h100 = 150_109_880_320, 85_899_345_920
    on, why = fits.choose_checkpointing(model_shape(spec3b), 4 * 2048, h200)
    assert on is False and why.startswith("off (estimate without it")
    on, why = fits.choose_checkpointing(model_shape(spec3b), 4 * 2048, h100)
    assert on is True and why.startswith("per layer")
