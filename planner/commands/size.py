"""``megatrain-plan size``: the least GPU memory, host RAM and NVMe a model needs, and its step on each GPU preset."""
from __future__ import annotations

import argparse
from typing import Any

from . import cli_args, data_parallel_report, report, report_size
from ..shapes import model_shapes
from ..choice import search, side_by_side
from ..profiling import hardware as hwmod
from .cli_args import NVME_DIR, parse_size

# A sizing question without a step named: 16 sequences of 4096 tokens (65k tokens per step).
SIZE_BATCH = 16


def add_parser(sub: Any) -> None:
    sp = sub.add_parser("size", help="minimum memory, and step time on each GPU preset")
    cli_args.workload_args(sp, need_batch=True, sizing_only=True, default_batch=SIZE_BATCH)
    sp.add_argument("--host", help=f"host preset for every GPU ({', '.join(hwmod.HOST_PRESETS)}); "
                                   "default: each GPU's usual host")
    sp.add_argument("--hardware", help=f"only this GPU preset ({', '.join(hwmod.GPU_PRESETS)}); default: every one")
    sp.add_argument("--ram", help="override host RAM on every preset, e.g. 1T")
    sp.add_argument("--nvme", type=cli_args.positive_float, help="override the NVMe read/write GB/s on every preset")
    data_parallel_report.add_arguments(sp, cli_args.positive_int, cli_args.positive_float)
    cli_args.json_arg(sp)


def run(args: argparse.Namespace) -> None:
    model = model_shapes.resolve(args.model)
    probe = hwmod.preset("H100-SXM")
    work = cli_args.workload(args, cli_args.compute_dtype(args, probe), spill_dir=args.spill_dir or NVME_DIR)
    least = search.minimum_memory(model, work, probe, data_parallel_report.checked_topology(args, work, probe))
    machines = []
    for name in _presets(args.hardware):
        hw = hwmod.preset(name, args.host).with_overrides(
            ram_bytes=parse_size(args.ram, "--ram") if args.ram else None, nvme_gbps=args.nvme)
        machines.append((name, hw, data_parallel_report.checked_topology(args, work, hw)))
    # Each preset's search is its own: side by side on the cores (the same results as in turn).
    results = side_by_side.run_apart([(search.search, (model, work, hw, ranks)) for _, hw, ranks in machines])
    presets = []
    for (name, hw, ranks), result in zip(machines, results):
        dp = (data_parallel_report.figures(model, work, result.best.plan, hw, ranks)
              if result.best is not None and ranks is not None else None)
        presets.append(report_size.Preset(name, hw, result, dp))
    data, text = report_size.page(model, work, least, presets, args.gpus_per_node, args.nodes)
    report.emit(args.json, data, text)


def _presets(hardware: str | None) -> list[str]:
    """The GPU presets to size: every one, or the one ``--hardware`` names (an unknown name: one line)."""
    if hardware is None:
        return list(hwmod.GPU_PRESETS)
    hwmod.preset(hardware)
    return [name for name in hwmod.GPU_PRESETS if name.lower() == hardware.lower()]
