"""The disk probe against the spill backend: what ``megatrain-plan profile`` measures, and what the runtime gets.

    python benchmarks/disk_probe.py --dir /path/on/nvme [--rounds 6]

Five ways of moving the same 1 GiB (64 MiB requests, 4 threads, O_DIRECT where the filesystem takes it), each a
rewrite pass then a read pass of a file written before, in rotating order within each round, so a disk whose
speed drifts over minutes moves them all alike:

  one buffer, same bytes         every request through one buffer (the probe before it gave each request its
                                 own, with pages of their own)
  a buffer each, same bytes      every request its own buffer, all holding the same bytes
  a buffer each, pages distinct  every request its own buffer, no two pages alike (as a model's state)
  the profile's                  ``host_probe._disk_pass`` as ``megatrain-plan profile`` runs it (its own file
                                 and buffers each pass; its rewrite timed with the fsync)
  the runtime's                  the spill backend (``PosixIO``, its thread pool) moving chunk-sized tensors of
                                 random values, as the staging sets and the loader move state

Reports the median GB/s each way with every sample. Writes
``benchmarks/results/<date>_<device>_disk_probe.{json,md}`` (``_2``, ... where a run that day took the name).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import mmap
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from megatrain.planner.profiling.host_probe import _disk_pass, io_buffers, stamp_pages  # noqa: E402
from result_files import machine, write_report  # noqa: E402

REQUEST = 64 << 20
COUNT = 16  # 1 GiB
THREADS = 4
WAYS = ("one buffer, same bytes", "a buffer each, same bytes", "a buffer each, pages distinct", "the profile's",
        "the runtime's")


def _direct_file(directory: str) -> tuple[int, str]:
    fd, path = tempfile.mkstemp(prefix="megatrain-disk-probe-", dir=directory)
    os.close(fd)
    return os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0)), path


def _passes(fd: int, buffers: list, restamp: bool = False) -> tuple[float, float]:
    """(read, write) GB/s: a rewrite of every request, then a read of every request, each from its buffer
    (``restamp``: its pages made distinct again after the read, not timed: the file holds the last write's)."""
    def run(op) -> float:
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(lambda i: op(fd, [buffers[i]], i * REQUEST), range(COUNT)))
        return COUNT * REQUEST / (time.perf_counter() - t0) / 1e9
    write = run(os.pwritev)
    read = run(os.preadv)
    if restamp:
        stamp_pages(buffers)
    return read, write


class _Runtime:
    """The spill backend on a preallocated file, a chunk-sized aligned tensor per request."""

    def __init__(self, directory: str) -> None:
        import torch

        from megatrain.runtime.spill.spill_io import PosixIO, aligned_empty

        self.io = PosixIO(THREADS, direct=True)
        self.path = os.path.join(directory, "megatrain-disk-probe-runtime.bin")
        self.handle = self.io.open(self.path, COUNT * REQUEST)
        self.chunks = [aligned_empty(REQUEST).view(torch.float32).uniform_() for _ in range(COUNT)]
        self.passes()  # writes the preallocated extents once, as a spill file's first step does

    def passes(self) -> tuple[float, float]:
        def run(op) -> float:
            t0 = time.perf_counter()
            for f in [op(self.handle, i * REQUEST, t) for i, t in enumerate(self.chunks)]:
                f.result()
            return COUNT * REQUEST / (time.perf_counter() - t0) / 1e9
        write = run(self.io.write)
        return run(self.io.read), write

    def close(self) -> None:
        self.io.close()
        os.unlink(self.path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="a folder on the disk to measure (the spill folder)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    if not os.path.isdir(args.dir):
        p.error(f"--dir={args.dir!r} is not a directory")
    data = os.urandom(REQUEST)
    shared = mmap.mmap(-1, REQUEST)
    shared.write(data)
    own = [mmap.mmap(-1, REQUEST) for _ in range(COUNT)]
    for b in own:
        b.write(data)
    distinct = io_buffers(COUNT, REQUEST)
    fd, path = _direct_file(args.dir)
    runtime = _Runtime(args.dir)
    try:
        _passes(fd, own)  # the file's extents, written once
        ways = {"one buffer, same bytes": lambda: _passes(fd, [shared] * COUNT),
                "a buffer each, same bytes": lambda: _passes(fd, own),
                "a buffer each, pages distinct": lambda: _passes(fd, distinct, restamp=True),
                "the profile's": lambda: _disk_pass(args.dir, COUNT * REQUEST, THREADS, REQUEST, direct=True),
                "the runtime's": runtime.passes}
        samples: dict[str, list[tuple[float, float]]] = {w: [] for w in WAYS}
        for r in range(args.rounds):
            order = WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]
            for way in order:
                samples[way].append(ways[way]())
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{w} {samples[w][-1][0]:.2f} / {samples[w][-1][1]:.2f}"
                                                              for w in WAYS), file=sys.stderr, flush=True)
    finally:
        os.close(fd)
        os.unlink(path)
        runtime.close()
    date = datetime.date.today().isoformat()
    command = f"python benchmarks/disk_probe.py --dir DIR --rounds {args.rounds}"
    report = {"date": date, "machine": machine(), "command": command, "request_bytes": REQUEST,
              "requests": COUNT, "threads": THREADS,
              "ways": {w: {"read_gbps": [r for r, _ in s], "write_gbps": [w_ for _, w_ in s]}
                       for w, s in samples.items()}}
    lines = [f"# The disk probe against the spill backend (cpu, {date})", "", f"`{command}`", "",
             f"{report['machine']['cores']} cores, {report['machine']['platform']}. 1 GiB in 64 MiB requests, "
             f"{THREADS} threads, O_DIRECT; each round a rewrite then a read per way, rotating order.", "",
             "| way | read GB/s (median) | write GB/s (median) | reads | writes |", "|---|---|---|---|---|"]
    for w, s in samples.items():
        reads, writes = [r for r, _ in s], [w_ for _, w_ in s]
        lines.append(f"| {w} | {statistics.median(reads):.2f} | {statistics.median(writes):.2f} | "
                     f"{' '.join(f'{x:.2f}' for x in reads)} | {' '.join(f'{x:.2f}' for x in writes)} |")
    write_report(os.path.join(args.out, f"{date}_cpu_disk_probe"), report, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
