"""The NVMe tier's I/O: megatrain's POSIX backend against a plain sequential read and write, one run.

    python benchmarks/spill_io.py --dir /path/on/nvme [--gib 1] [--block-mib 16]

Both move the same bytes in the same directory. Plain: one ``write`` of the whole
buffer + fsync, then one ``readinto`` after dropping the file from the page cache.
megatrain: the spill backend (thread pool of pwritev/preadv, O_DIRECT where the
filesystem takes it) moving 4 KiB-aligned blocks as AdamW's staging does, all
blocks in flight, then fsync. Also the step time of a small model trained with
``spill="all"`` against the same model with nothing spilled.
Writes ``benchmarks/results/<date>_<device>_spill_io.{json,md}``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch

from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan
from megatrain.runtime.spill.spill_io import PosixIO, aligned_empty
from result_files import machine, write_report

HERE = os.path.dirname(os.path.abspath(__file__))


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain(path: str, data: torch.Tensor) -> tuple[float, float]:
    raw = memoryview(data.numpy())
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        f.write(raw)
        os.fsync(f.fileno())
    write = time.perf_counter() - t0
    drop_cache(path)
    out = torch.empty_like(data)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        f.readinto(memoryview(out.numpy()))
    read = time.perf_counter() - t0
    assert torch.equal(out, data)
    return write, read


def backend(path: str, data: torch.Tensor, block: int, threads: int) -> tuple[float, float, bool]:
    io = PosixIO(threads)
    try:
        handle = io.open(path, data.numel())
        t0 = time.perf_counter()
        for f in [io.write(handle, o, data[o:o + block]) for o in range(0, data.numel(), block)]:
            f.result()
        os.fsync(io._fds[handle][0])
        write = time.perf_counter() - t0
        drop_cache(path)
        out = aligned_empty(data.numel())
        t0 = time.perf_counter()
        for f in [io.read(handle, o, out[o:o + block]) for o in range(0, data.numel(), block)]:
            f.result()
        read = time.perf_counter() - t0
        assert torch.equal(out, data)
        return write, read, io.direct
    finally:
        io.close()


def training(spill_dir: str, steps: int) -> dict[str, float]:
    config = ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=2)
    out = {}
    for spill in ("none", "all"):
        plan = Plan(spill=spill, spill_dir=spill_dir if spill != "none" else None)
        with Engine(config, OptimizerConfig(lr=1e-4), plan=plan, compute_dtype=torch.float32, device="cpu") as e:
            ids = torch.randint(0, 8192, (4, 128))
            times = []
            for i in range(steps):
                t0 = time.perf_counter()
                e.step(ids, ids).item()
                e.synchronize()  # the step's updates (and their writes behind) included
                times.append(time.perf_counter() - t0)
                print(f"  train spill={spill} step {i + 1}/{steps}: {times[-1]:.2f} s", file=sys.stderr, flush=True)
            out[spill] = statistics.median(times[1:])
            out["params"] = e.num_parameters
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temporary one)")
    p.add_argument("--gib", type=float, default=0.5)
    p.add_argument("--block-mib", type=int, default=16)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="megatrain-spill-bench-")
    nbytes = int(args.gib * 2**30) // 4096 * 4096
    block = args.block_mib * 2**20
    data = aligned_empty(nbytes)
    data.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    path = os.path.join(directory, "bench.bin")
    rows = []
    for i in range(2):  # alternate, twice, so neither always runs on a warmer disk
        pw, pr = plain(path, data)
        os.remove(path)
        bw, br, direct = backend(path, data, block, args.threads)
        os.remove(path)
        rows.append((pw, pr, bw, br))
        print(f"  round {i + 1}: plain w {nbytes / pw / 1e9:.2f} r {nbytes / pr / 1e9:.2f} GB/s; "
              f"backend w {nbytes / bw / 1e9:.2f} r {nbytes / br / 1e9:.2f} GB/s (O_DIRECT {direct})",
              file=sys.stderr, flush=True)
    best = [min(r[i] for r in rows) for i in range(4)]
    gbps = [nbytes / t / 1e9 for t in best]
    train = training(directory, args.steps)
    report = {"date": datetime.date.today().isoformat(), "machine": machine(), "directory": directory, "bytes": nbytes,
              "block_bytes": block, "threads": args.threads, "o_direct": direct,
              "plain_write_gbps": gbps[0], "plain_read_gbps": gbps[1], "backend_write_gbps": gbps[2],
              "backend_read_gbps": gbps[3], "write_ratio": gbps[2] / gbps[0], "read_ratio": gbps[3] / gbps[1],
              "train_step_seconds": train}
    lines = [f"# Spill I/O, {nbytes / 2**30:.2f} GiB in {args.block_mib} MiB blocks, {args.threads} threads "
             f"({report['date']})", "", "| | write GB/s | read GB/s |", "|---|---|---|",
             f"| plain sequential | {gbps[0]:.2f} | {gbps[1]:.2f} |",
             f"| megatrain POSIX backend (O_DIRECT {direct}) | {gbps[2]:.2f} | {gbps[3]:.2f} |",
             f"| ratio | {gbps[2] / gbps[0]:.2f}x | {gbps[3] / gbps[1]:.2f}x |", "",
             f"Training step ({train['params'] / 1e6:.1f}M params, fp32, CPU): {train['none']:.2f} s with nothing "
             f"spilled, {train['all']:.2f} s with spill='all' ({train['all'] / train['none']:.2f}x)."]
    write_report(os.path.join(args.out, f"{report['date']}_cpu_spill_io"), report, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
