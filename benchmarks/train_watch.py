"""Run a megatrain-train command, sample the disk it fills, and stop it after N steps without its last checkpoint.

    python benchmarks/train_watch.py --stop-after 6 --run-dir RUN --watch SPILL --record watch.json -- \\
        megatrain-train ... --steps 6 --out RUN --spill-dir SPILL

megatrain-train always ends with a checkpoint (``--save-every 0``: at the end and on Ctrl-C). On the GPU
machine's 64 GiB disk the largest model's does not fit: Qwen2.5-14B's shape with bf16 AdamW state checkpoints
8 bytes a parameter (fp32 master, bf16 m and v), 110.0 GiB, beside its 55.0 GiB of spill files (m and v); a
6.9B mixture of experts with fp32 state, 12 bytes a parameter, 76.6 GiB. Every step's figures are in
``RUN/metrics.jsonl`` as the step ends (tokens/s, peak GPU and host memory so far), so once its ``--stop-after``
th row is there this stops the run as a user would without waiting for a save: Ctrl-C twice (SIGINT; the second
exits at once, no checkpoint), and SIGKILL if it has not exited 30 s later. Meanwhile it samples, every
``--interval`` seconds, the bytes allocated under each ``--watch`` folder (the spill files) and the free space of
its disk: the peaks go into ``--record`` (JSON) with the exit status, the rows seen and the seconds taken.
Exit status: 0 when the run was stopped after its rows (or ended by itself with 0), else the run's own.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

GRACE_S = 30.0  # after the two SIGINTs, before SIGKILL


def allocated_bytes(folder: str) -> int:
    """Bytes the files under ``folder`` occupy on its disk (allocated blocks: a sparse or preallocated spill
    file counts what it holds); 0 when the folder is not there."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:  # removed while walked
                pass
    return total


def rows(path: str) -> int:
    """Complete lines of a metrics.jsonl (0 before it exists)."""
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def free_bytes(folder: str) -> int | None:
    """Free bytes of the disk under ``folder`` (the nearest existing parent's)."""
    path = os.path.abspath(folder)
    while not os.path.exists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C twice (megatrain-train: the first asks for a checkpointed stop, the second exits at once), then
    SIGKILL if it is still there after ``GRACE_S``."""
    for _ in range(2):
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            time.sleep(1.0)
    try:
        proc.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def watch(command: list[str], run_dir: str, stop_after: int, folders: list[str], interval: float) -> dict[str, Any]:
    metrics = os.path.join(run_dir, "metrics.jsonl")
    peak = dict.fromkeys(folders, 0)
    least_free: int | None = None
    t0 = time.monotonic()
    proc = subprocess.Popen(command)
    stopped = False
    try:
        while proc.poll() is None:
            for d in folders:
                peak[d] = max(peak[d], allocated_bytes(d))
                free = free_bytes(d)
                if free is not None:
                    least_free = free if least_free is None else min(least_free, free)
            if stop_after and rows(metrics) >= stop_after:
                stop(proc)
                stopped = True
                break
            time.sleep(interval)
    except KeyboardInterrupt:  # the caller's time limit: the run gets the same Ctrl-C, then the record is written
        stop(proc)
    proc.wait()
    return {"command": command, "exit_code": proc.returncode, "stopped_after_rows": stop_after if stopped else None,
            "rows": rows(metrics), "seconds": time.monotonic() - t0, "peak_allocated_bytes": peak,
            "least_free_bytes": least_free, "interval_s": interval}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stop-after", type=int, default=0, help="stop the run once RUN/metrics.jsonl has this many "
                                                             "rows (0: let it end by itself)")
    p.add_argument("--run-dir", required=True, help="the run's --out")
    p.add_argument("--watch", action="append", default=[], help="a folder whose allocated bytes are sampled "
                                                                "(repeatable; the spill directory)")
    p.add_argument("--record", required=True, help="where the JSON record goes")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between samples (2)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the megatrain-train command")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.stop_after < 0 or args.interval <= 0:
        print("train_watch: give -- COMMAND, --stop-after >= 0 and --interval > 0", file=sys.stderr)
        return 2
    record = watch(command, args.run_dir, args.stop_after, args.watch, args.interval)
    os.makedirs(os.path.dirname(os.path.abspath(args.record)), exist_ok=True)
    with open(args.record, "w") as f:
        json.dump(record, f, indent=1)
    gib = {d: f"{b / 2**30:.2f} GiB" for d, b in record["peak_allocated_bytes"].items()}
    print(f"train_watch: {record['rows']} rows in {record['seconds']:.0f} s, exit {record['exit_code']}"
          f"{' (stopped after its rows)' if record['stopped_after_rows'] else ''}; peak allocated {gib}; least free "
          f"{(record['least_free_bytes'] or 0) / 2**30:.2f} GiB; wrote {args.record}", flush=True)
    return 0 if record["stopped_after_rows"] or record["exit_code"] == 0 else record["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
