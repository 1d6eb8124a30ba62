"""Checkpoint write / read GB/s against a plain copy of the same bytes, and the training stall, in one run.

    python benchmarks/checkpoint_io.py                      # ~80M parameters: 0.96 GB of master + AdamW state
    python benchmarks/checkpoint_io.py --layers 24 --dir /nvme/scratch

The same three fp32 arenas (master, exp_avg, exp_avg_sq) are written and read
(1) plainly: one file each, ``write`` + ``fsync``, read back with ``readinto``
into the arenas; (2) as a megatrain checkpoint: ``save_checkpoint(blocking=True)``
(tensorstore zarr3 + CRC32s + fsyncs + manifest + renames) and
``Engine.load_checkpoint`` (arrays read into a fresh engine's store, CRC32s
verified): the read is timed inside that call (resolve + manifest check +
restore), without the engine's construction, which is reported on its own
(it varies by 0.4-1.3 s from run to run on a small VM: subtracting a separate
timing of it, as this benchmark first did, was noise of the size of the read).
Before every read the files are dropped from the page cache
(``posix_fadvise(DONTNEED)``), so reads come from the disk (a VM's host may
still cache). Then the asynchronous path: ``save_checkpoint(blocking=False)``'s
stall (the snapshot copy) and the median step time while the write runs against
the median without one. Writes ``benchmarks/results/<date>_<device>_checkpoint_io.{json,md}``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan

from megatrain.runtime.io import training_checkpoint
from result_files import machine, write_report

HERE = os.path.dirname(os.path.abspath(__file__))


def drop_cache(root: str) -> None:
    for dirpath, _, names in os.walk(root):
        for n in names:
            fd = os.open(os.path.join(dirpath, n), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def arenas(engine: Engine) -> dict[str, torch.Tensor]:
    s = engine.store
    return {"master": s.master.tensor, "exp_avg": s.exp_avg.tensor, "exp_avg_sq": s.exp_avg_sq.tensor}


def plain_write(engine: Engine, root: str) -> float:
    start = time.perf_counter()
    for name, t in arenas(engine).items():
        with open(os.path.join(root, name), "wb") as f:
            f.write(memoryview(t.numpy()))
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - start


def plain_read(engine: Engine, root: str) -> float:
    start = time.perf_counter()
    for name, t in arenas(engine).items():
        with open(os.path.join(root, name), "rb", buffering=0) as f:
            view, got = memoryview(t.view(torch.uint8).numpy()), 0
            while got < len(view):
                got += f.readinto(view[got:])
    return time.perf_counter() - start


def timed_load(directory: str) -> tuple[Engine, float]:
    """Engine.load_checkpoint(directory) and the seconds spent in its checkpoint reading (all but construction)."""
    spent = [0.0]
    originals = {name: getattr(training_checkpoint, name) for name in ("resolve", "read_manifest", "restore")}

    def timing(fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return run

    for name, fn in originals.items():
        setattr(training_checkpoint, name, timing(fn))
    try:
        engine = Engine.load_checkpoint(directory, device="cpu")
    finally:
        for name, fn in originals.items():
            setattr(training_checkpoint, name, fn)
    return engine, spent[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    config = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64)
    plan = Plan(micro_batch_size=1, loss_chunk_tokens=256)
    scratch = tempfile.mkdtemp(prefix="megatrain-ckpt-", dir=args.dir)
    ids = torch.randint(0, args.vocab, (1, 64), generator=torch.Generator().manual_seed(0))
    try:
        engine = Engine(config, OptimizerConfig(lr=1e-4), plan=plan, compute_dtype=torch.float32, device="cpu")
        engine.step(ids, ids)  # nonzero m and v
        engine.synchronize()
        nbytes = sum(t.numel() * 4 for t in arenas(engine).values())
        plain = os.path.join(scratch, "plain")
        os.makedirs(plain)
        w_plain = plain_write(engine, plain)
        drop_cache(plain)
        r_plain = plain_read(engine, plain)

        ckpt = os.path.join(scratch, "ckpt")
        start = time.perf_counter()
        engine.save_checkpoint(ckpt, blocking=True)
        w_ckpt = time.perf_counter() - start
        drop_cache(ckpt)
        start = time.perf_counter()
        Engine(config, OptimizerConfig(lr=1e-4), plan=plan, compute_dtype=torch.float32, device="cpu",
               _skip_init=True).close()
        construct = time.perf_counter() - start
        loaded, r_ckpt = timed_load(ckpt)
        loaded.close()

        steps_plain = []
        for _ in range(5):
            t = time.perf_counter()
            engine.step(ids, ids)
            engine.synchronize()
            steps_plain.append(time.perf_counter() - t)
        handle = engine.save_checkpoint(ckpt, keep=1)
        steps_during = []
        while not handle.done() or not steps_during:
            t = time.perf_counter()
            engine.step(ids, ids)
            engine.synchronize()
            steps_during.append(time.perf_counter() - t)
        handle.wait()
        engine.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    gb = nbytes / 1e9
    rows = {
        "state_gb": round(gb, 3), "parameters": engine.num_parameters,
        "plain_write_gbps": round(gb / w_plain, 3), "checkpoint_write_gbps": round(gb / w_ckpt, 3),
        "plain_read_gbps": round(gb / r_plain, 3), "checkpoint_read_gbps": round(gb / r_ckpt, 3),
        "engine_construct_s": round(construct, 3),
        "async_stall_s": round(handle.stall_s, 4), "async_write_s": round(handle.write_s, 3),
        "step_s_median": round(statistics.median(steps_plain), 4),
        "step_s_median_during_write": round(statistics.median(steps_during), 4),
        "steps_during_write": len(steps_during),
    }
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = {**machine(), "scratch": args.dir or tempfile.gettempdir()}
    report = {"date": datetime.date.today().isoformat(), "machine": info, "args": vars(args), "results": rows}
    lines = [f"# Checkpoint I/O, {device} ({report['date']})", "",
             f"{rows['parameters'] / 1e6:.1f}M parameters, {gb:.3f} GB of fp32 master + AdamW m + v; "
             f"{info['cores']} cores; scratch {info['scratch']}; page cache dropped before reads.", "",
             "| path | write GB/s | read GB/s |", "|---|---|---|",
             f"| plain copy (write+fsync / readinto) | {rows['plain_write_gbps']} | {rows['plain_read_gbps']} |",
             f"| megatrain checkpoint (tensorstore, CRC32, fsync, commit) | {rows['checkpoint_write_gbps']} | "
             f"{rows['checkpoint_read_gbps']} |", "",
             f"Asynchronous save: training stalled {rows['async_stall_s']} s (snapshot copy) for a "
             f"{rows['async_write_s']} s background write; median step {rows['step_s_median']} s without a "
             f"write, {rows['step_s_median_during_write']} s during one ({rows['steps_during_write']} steps)."]
    write_report(os.path.join(args.out, f"{report['date']}_{device}_checkpoint_io"), report, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
