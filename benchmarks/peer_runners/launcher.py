"""The parent's side of one run: start the child, watch the machine's memory and the clock, read the result.

The child runs in its own process group with its output in a log file. Every 0.2 s the
parent samples the memory the machine has left (pinned memory included, which a process's
RSS may not show) and echoes the child's progress lines. It stops the child (its whole
process group, SIGKILL) when the machine is about to run out of host memory (so that the
kernel's OOM killer never has to choose, and the machine stays usable for the next run)
or when its time is up. A child that dies without a result is classified from how it died.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from . import memory
from .spec import RunSpec

PEERS_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "peers.py")
POLL_SECONDS = 0.2
TEARDOWN_SECONDS = 60  # a child that has written its result gets this long to exit
GIB = 2**30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_margin() -> int:
    """Stop a child when less than this is left: 3% of the machine's memory, at least 2 GiB."""
    total = memory.host_total() or 0
    return max(2 * GIB, int(0.03 * total))


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _last_error_line(log_tail: str) -> str:
    for line in reversed(log_tail.strip().splitlines()):
        if line.strip() and not line.startswith(" "):
            return line.strip()[:300]
    return "no output"


def child_env() -> dict[str, str]:
    """A world of one process for torch.distributed / DeepSpeed, on a free local port."""
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               LOCAL_WORLD_SIZE="1", PYTHONUNBUFFERED="1")
    return env


def run_probe(device: str, timeout: float = 300) -> dict[str, Any]:
    """The machine's description and matmul peak (``probe.py``), from a subprocess."""
    with tempfile.TemporaryDirectory(prefix="peers-probe-") as tmp:
        path = os.path.join(tmp, "probe.json")
        proc = subprocess.run([sys.executable, PEERS_PY, "--probe", path, "--device", device],
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(path):
            raise SystemExit(f"the machine probe failed (exit {proc.returncode}): "
                             f"{_last_error_line(proc.stderr or proc.stdout)}")
        with open(path) as f:
            return json.load(f)


def build_deepspeed_ops(timeout: float, log_path: str) -> tuple[str, float]:
    """JIT-build DeepSpeedCPUAdam once, before the DeepSpeed runs (ninja; minutes the first time on a machine).

    Returns ("ok" or why not, seconds). Apart from the runs so that no run's setup time includes the
    build, and a build that fails says so once."""
    t0 = time.monotonic()
    code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, env=child_env(),
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            return f"timed out after {timeout:.0f} s (see {log_path})", time.monotonic() - t0
    if proc.returncode != 0:
        return f"exit status {proc.returncode}: {_last_error_line(_tail(log_path))}", time.monotonic() - t0
    return "ok", time.monotonic() - t0


def launch(spec: RunSpec, timeout: float, log_path: str, echo: Callable[[str], None],
           budget_end: float | None = None) -> dict[str, Any]:
    """Run ``spec`` in a child; returns its raw result with the parent's readings added:
    ``host_used_peak_bytes`` (the most the machine's available memory fell below where it was at the start),
    ``wall_seconds``, and for a run that did not end well, ``log_tail``.

    ``timeout`` bounds this run; ``budget_end`` (a ``time.monotonic()`` instant), when the run is stopped
    by it, makes the status say the time budget ran out rather than that the run took too long."""
    tmp = tempfile.mkdtemp(prefix=f"peers-{spec.system}-")
    spec = spec.replace(result_path=os.path.join(tmp, "result.json"), progress_path=os.path.join(tmp, "progress.jsonl"))
    spec_path = os.path.join(tmp, "spec.json")
    with open(spec_path, "w") as f:
        f.write(spec.to_json())
    start_avail = memory.host_available()
    margin = host_margin() if start_avail is None else min(host_margin(), start_avail // 2)
    result_seen: float | None = None
    low_avail = start_avail
    t0 = time.monotonic()
    stopped: str | None = None
    last: dict[str, Any] = {}
    seen = 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, PEERS_PY, "--child", spec_path], stdout=log, stderr=subprocess.STDOUT,
                                env=child_env(), start_new_session=True)
        while proc.poll() is None:
            time.sleep(POLL_SECONDS)
            avail = memory.host_available()
            if avail is not None:
                low_avail = avail if low_avail is None else min(low_avail, avail)
            seen, last = _echo_progress(spec, seen, last, echo)
            if avail is not None and avail < margin and stopped is None:
                stopped = (f"out of memory (host, {avail / GIB:.1f} GiB left of the machine, child RSS "
                           f"{(last.get('rss') or 0) / GIB:.1f} GiB, peak {(last.get('hwm') or 0) / GIB:.1f} GiB): "
                           f"stopped by the harness before the OOM killer")
                _kill(proc)
            elif result_seen is None and os.path.exists(spec.result_path):
                result_seen = time.monotonic()
            elif result_seen is not None and time.monotonic() - result_seen > TEARDOWN_SECONDS:
                echo(f"    {spec.system}: still tearing down {TEARDOWN_SECONDS} s after writing its result; stopped")
                _kill(proc)
            elif time.monotonic() - t0 > timeout and stopped is None:
                out_of_budget = budget_end is not None and time.monotonic() >= budget_end - 1
                stopped = (f"not run: the time budget ran out after {timeout:.0f} s of this run" if out_of_budget
                           else f"failed: timed out after {timeout:.0f} s")
                _kill(proc)
        seen, last = _echo_progress(spec, seen, last, echo)
    result = _read_result(spec.result_path)
    shutil.rmtree(tmp, ignore_errors=True)
    if stopped is not None and (result is None or result.get("status") != "ok"):
        result = {**(result or {}), "system": spec.system, "status": stopped}
    elif result is None:
        result = {"system": spec.system, "status": _death(proc.returncode, log_path)}
    # else: a result, and a stop only in a hung teardown after it was written: the result stands.
    if result.get("peak_host_rss_bytes") is None and last.get("hwm"):
        result["peak_host_rss_bytes"] = last["hwm"]
    if start_avail is not None and low_avail is not None:
        result["host_used_peak_bytes"] = max(0, start_avail - low_avail)
    result["wall_seconds"] = time.monotonic() - t0
    if result.get("status") != "ok":
        result["log_tail"] = _tail(log_path)
    return result


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own process group: it and what it started (ninja)
    except ProcessLookupError:
        pass
    proc.wait()


def _death(returncode: int, log_path: str) -> str:
    if returncode in (-signal.SIGKILL, 137):
        return "out of memory (host): killed by SIGKILL, most likely the kernel's OOM killer"
    return f"failed: exit status {returncode}: {_last_error_line(_tail(log_path))}"


def _read_result(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _echo_progress(spec: RunSpec, seen: int, last: dict[str, Any], echo: Callable[[str], None]) -> tuple[int, dict]:
    try:
        with open(spec.progress_path) as f:
            lines = f.readlines()
    except OSError:
        return seen, last
    for line in lines[seen:]:
        if not line.endswith("\n"):
            break  # being written
        seen += 1
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        last = event
        rss = f"RSS {(event.get('rss') or 0) / GIB:.1f} GiB"
        if event.get("phase") == "step":
            echo(f"    {spec.system} step {event['step']}/{event['steps']}: {event['seconds']:.3f} s, "
                 f"loss {event['loss']:.4f}, {rss}")
        elif event.get("phase") == "ready":
            echo(f"    {spec.system} ready after {event['seconds']:.1f} s, {rss}")
    return seen, last
