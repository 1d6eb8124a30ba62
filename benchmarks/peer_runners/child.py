"""One system's run, in a fresh subprocess: setup, timed steps, peaks and a status, written as JSON.

A system is a module ``run_<name>.py`` whose ``build(spec)`` returns a trainer:

    trainer.params          distinct parameters (a tied weight once)
    trainer.details         what ran (dtypes, plan, offload, optimizer), for the report
    trainer.step(ids)       one optimizer step over ids [batch, seq] (int64, host); returns the mean loss
    trainer.drain()         waits for everything queued (deferred optimizer work, device streams)
    trainer.breakdown()     the last step's time breakdown (megatrain), or None
    trainer.pinned_bytes()  pinned host bytes outside torch's pinned allocator, or None
    trainer.close()

[Note: step timing] Steps run back to back; step i's time is the interval between the
completions of steps i - 1 and i (step 0's from the end of setup). Work a system defers
(megatrain's AdamW of step i overlapping step i + 1's forward) lands in the interval it delays,
so in steady state every interval holds one step's whole work. After the ``steps`` timed steps
one more step runs untimed (the tail: it pays the last timed step's deferred work), then
``drain()``; both are recorded apart (``tail_step_seconds``, ``drain_seconds``) and never added
to a timed step. The first ``warmup`` steps are left out of the median and of the spread
(min / median / max).

[Note: peaks] Peak GPU memory is ``torch.cuda.max_memory_allocated`` over the timed
steps (reset after setup; the setup peak is recorded apart). Peak host RSS is VmHWM
over the timed steps where the kernel lets it be reset (``clear_refs``), else since the
process began; the setup peak is recorded apart. Pinned memory: torch's pinned allocator's
peak plus what the system pinned itself (megatrain registers its arenas).
"""
from __future__ import annotations

import importlib
import json
import os
import time
import traceback
from typing import Any

from . import memory
from .spec import NotRun, RunSpec, batches


class Progress:
    """One JSON line per phase and step in ``path``: the parent echoes them and keeps the last peak."""

    def __init__(self, path: str) -> None:
        self.path = path

    def write(self, **event: Any) -> None:
        if not self.path:
            return
        mem = memory.process_memory()
        event.update(rss=mem["VmRSS"], hwm=mem["VmHWM"])
        with open(self.path, "a") as f:
            f.write(json.dumps(event) + "\n")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:400]


def _cuda_peaks(torch) -> dict[str, int]:
    return {"peak_gpu_bytes": int(torch.cuda.max_memory_allocated()),
            "peak_gpu_reserved_bytes": int(torch.cuda.max_memory_reserved())}


def _torch_pinned_peak(torch) -> int | None:
    try:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.peak", 0))
    except (AttributeError, RuntimeError):
        return None


def status_of(e: BaseException, result: dict[str, Any]) -> str:
    """``out of memory (<where>, peak ...): <message>`` or ``failed: <type>: <message>``."""
    msg = _first_line(e)
    low = msg.lower()
    if type(e).__name__ == "OutOfMemoryError" or "out of memory" in low:
        gpu = "cuda" in low or type(e).__name__ == "OutOfMemoryError"
        peak = result.get("peak_gpu_bytes") if gpu else result.get("peak_host_rss_bytes")
        where = "GPU" if gpu else "host"
        at = f", peak {peak / 2**30:.1f} GiB" if peak else ""
        return f"out of memory ({where}{at}): {msg}"
    return f"failed: {type(e).__name__}: {msg}"


def run(spec: RunSpec) -> tuple[dict[str, Any], Any]:
    """The run's result, and the trainer (None if setup failed) for the caller to close after saving."""
    import torch

    progress = Progress(spec.progress_path)
    cuda = spec.device == "cuda"
    result: dict[str, Any] = {"system": spec.system, "status": "failed: setup did not finish"}
    trainer = None
    t_start = time.perf_counter()
    try:
        if cuda:
            torch.cuda.set_device(0)
        progress.write(phase="setup")
        trainer = importlib.import_module(f"peer_runners.run_{spec.system}").build(spec)
        result.update(params=trainer.params, details=trainer.details)
        data = batches(spec)
        if cuda:
            torch.cuda.synchronize()
            result["setup_peak_gpu_bytes"] = int(torch.cuda.max_memory_allocated())
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        result["setup_peak_host_rss_bytes"] = memory.process_memory()["VmHWM"]
        result["peak_rss_reset"] = memory.reset_peak_rss()
        result["setup_seconds"] = time.perf_counter() - t_start
        progress.write(phase="ready", seconds=result["setup_seconds"])

        times: list[float] = []
        losses: list[float] = []
        breakdowns: list[dict[str, float] | None] = []
        timed, tail = data[:spec.steps], data[spec.steps]
        t_prev = time.perf_counter()
        for i, ids in enumerate(timed):
            losses.append(trainer.step(ids))
            breakdowns.append(trainer.breakdown())
            now = time.perf_counter()
            times.append(now - t_prev)
            t_prev = now
            progress.write(phase="step", step=i + 1, steps=len(timed), seconds=times[-1], loss=losses[-1])
        result["tail_loss"] = trainer.step(tail)  # untimed ([Note: step timing])
        result["tail_step_seconds"] = time.perf_counter() - t_prev
        t_drain = time.perf_counter()
        trainer.drain()
        result["drain_seconds"] = time.perf_counter() - t_drain
        result.update(status="ok", step_seconds=times, losses=losses)
        if any(b is not None for b in breakdowns):
            result["breakdowns"] = breakdowns
    except NotRun as e:
        result["status"] = f"not run: {e}"
    except BaseException as e:  # recorded, not raised: one system's failure is one row of the comparison
        result["error"] = traceback.format_exc()[-4000:]
        if cuda:
            result.update(_cuda_peaks(torch))
        result["peak_host_rss_bytes"] = memory.process_memory()["VmHWM"]
        result["status"] = status_of(e, result)
    finally:
        if cuda:
            result.update(_cuda_peaks(torch))
            result["torch_pinned_peak_bytes"] = _torch_pinned_peak(torch)
        mem = memory.process_memory()
        result.update(peak_host_rss_bytes=mem["VmHWM"], host_rss_bytes=mem["VmRSS"], host_locked_bytes=mem["VmLck"])
        if trainer is not None:
            try:
                result["system_pinned_bytes"] = trainer.pinned_bytes()
            except Exception:  # a reading, never a reason to lose the result
                result["system_pinned_bytes"] = None
        result["child_seconds"] = time.perf_counter() - t_start
    return result, trainer


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = RunSpec.from_json(f.read())
    result, trainer = run(spec)
    tmp = spec.result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, spec.result_path)  # the parent reads a whole result or none
    if trainer is not None:  # after saving: a teardown that hangs or fails loses nothing
        try:
            trainer.close()
        except Exception:
            traceback.print_exc()
    return 0
