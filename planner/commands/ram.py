"""``megatrain-plan ram``: how much host RAM (and NVMe) to buy: batch and throughput per RAM size, and the least
RAM reaching a throughput target."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from . import cli_args, data_parallel_report, report, report_ram
from ..shapes import model_shapes
from ..choice import sizing
from ..choice.ram_answers import ram_answers
from .cli_args import NVME_DIR, parse_size
from ..shapes.workload import Workload

# NVMe size the purchase table assumes when --nvme-size is not given.
DEFAULT_NVME_SIZE = "4T"


def add_parser(sub: Any) -> None:
    sp = sub.add_parser("ram", help="how much host RAM (and NVMe) to buy: batch and throughput per RAM size, "
                                    "and the least RAM for a throughput target")
    cli_args.workload_args(sp, need_batch=False, sizing_only=True)
    sp.add_argument("--tokens-per-second", type=cli_args.positive_float, help="throughput target (optional)")
    sp.add_argument("--nvme-size", default=DEFAULT_NVME_SIZE,
                    help=f"NVMe size of the with-NVMe columns (default {DEFAULT_NVME_SIZE}); its speed: --nvme GB/s, "
                         "else the hardware's, else an assumed figure")
    sp.add_argument("--price-per-gb", type=cli_args.positive_float,
                    help=f"USD per GB (default {report_ram.DEFAULT_PRICE_PER_GB}, an assumption)")
    sp.add_argument("--max-batch", type=cli_args.positive_int, default=4096, help="largest batch to try (4096)")
    cli_args.hardware_args(sp)
    data_parallel_report.add_arguments(sp, cli_args.positive_int, cli_args.positive_float)
    cli_args.json_arg(sp)


def run(args: argparse.Namespace) -> None:
    model = model_shapes.resolve(args.model)
    hw, measured = sizing.with_disk(cli_args.resolve_hardware(args))
    nvme_size = parse_size(args.nvme_size, "--nvme-size")
    work = Workload(args.seq_len, 1, cli_args.compute_dtype(args, hw), clipping=not args.no_clip, spill=args.spill,
                    spill_dir=args.spill_dir or NVME_DIR, spill_free_bytes=nvme_size,
                    optimizer_state=args.optimizer_state, nonblocking_saves=bool(args.save_every))
    ranks = data_parallel_report.checked_topology(
        args, dataclasses.replace(work, batch=args.gpus_per_node * args.nodes), hw)
    target = args.tokens_per_second
    ladder, answer = ram_answers(model, work, hw, args.max_batch, target, ranks)
    scaling = [None if ranks is None or r.choice is None else data_parallel_report.figures(
        model, dataclasses.replace(work, batch=r.batch), r.choice.plan, sizing.with_ram(hw, r.ram_bytes), ranks)
        for r in ladder]
    data, text = report_ram.page(report_ram.RamQuestion(
        model, work, hw, measured, nvme_size, args.price_per_gb, args.max_batch, ranks, target),
        ladder, scaling, answer)
    report.emit(args.json, data, text)
