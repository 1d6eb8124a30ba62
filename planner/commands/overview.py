"""``megatrain-plan`` with no command: what this machine (or a GPU preset) can train, every preset model."""
from __future__ import annotations

import argparse
import dataclasses
import os

from . import cli_args, report, report_overview
from ..profiling import disk_space
from ..shapes import model_shapes
from ..choice import side_by_side, sizing
from .cli_args import CliError
from ..shapes.workload import Workload


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The overview's options, on the top-level parser."""
    cli_args.json_arg(p)
    cli_args.seq_len_arg(p, default=4096, help="overview: tokens per sequence (4096)")
    p.add_argument("--batch", type=cli_args.positive_int, default=None,
                   help="overview: sequences per step (default: the largest of 16, 8, 4, 2, 1 that fits)")
    p.add_argument("--dtype", default="auto", help="overview: compute dtype (default auto: bf16 unless the hardware "
                                                   "multiplies fp32 faster)")
    p.add_argument("--no-clip", action="store_true", help="overview: no gradient clipping")
    p.add_argument("--spill-dir", help="overview: where spill files would go (default: the current directory)")
    cli_args.hardware_args(p)


def run(args: argparse.Namespace) -> None:
    base = cli_args.resolve_hardware(args)
    preset = cli_args.is_preset(args)
    spill_dir = os.path.abspath(args.spill_dir or os.getcwd())
    if not preset and not os.path.isdir(spill_dir):
        raise CliError(f"--spill-dir={args.spill_dir!r} is not a directory; pass an existing folder on a fast disk")
    # This machine: the disk under the spill folder, its free space measured now. A preset: its NVMe, any size.
    free = None if preset else disk_space.free_bytes(spill_dir)
    hw, measured = sizing.with_disk(base)
    dtype = cli_args.compute_dtype(args, hw)
    batches = (args.batch,) if args.batch else sizing.OVERVIEW_BATCHES
    work = Workload(args.seq_len, max(batches), dtype, clipping=not args.no_clip, spill_dir=spill_dir,
                    spill_free_bytes=free)
    # Each model's answer is its own searches: side by side on the cores (the same answers as in turn).
    answers = dict(zip(model_shapes.PRESETS, side_by_side.run_apart(
        [(sizing.what_fits, (model, work, hw, batches)) for model in model_shapes.PRESETS.values()])))
    # The largest Llama-shaped model for the RAM and the disk's free space together (a preset's disk: any size).
    big = None if free is None else sizing.largest_llama(dataclasses.replace(work, batch=1), hw)
    data, text = report_overview.page(report_overview.Overview(
        hw, measured, preset, work, batches, bool(args.batch), dtype, args.dtype == "auto", answers,
        big))
    report.emit(args.json, data, text)
