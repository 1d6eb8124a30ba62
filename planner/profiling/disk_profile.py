"""The spill disk's figures in a hardware profile: measured in a folder (``measure_disk``, which
``megatrain-plan profile --spill-dir`` runs with the rest) and put into a saved profile on their own
(``with_disk_measured``: ``megatrain-plan profile --disk-only``), every other figure and the calibrations kept.

A disk's speed can move between a profile and a run (this project's virtual disk read 2.4 GB/s, then 3.5
three minutes later); a spilled plan's predicted step is as true as these figures are recent, and they are the
only ones measuring again does not make the calibration stale (``calibrate`` fits compute, copies, AdamW and
memory, none of them the disk's). Pure stdlib: the compute timed beside the I/O comes from the caller
(``profiler.cpu_matmul``).
"""
from __future__ import annotations

import datetime
from typing import Any, Callable

from megatrain.planner.profiling import disk_contention
from megatrain.planner.profiling.hardware import GiB, HardwareProfile
from megatrain.planner.profiling.host_probe import disk_bandwidth

# A profile's source clauses this module writes or replaces.
MEASURED, NOT_MEASURED = "disk re-measured", "disk not measured"


def measure_disk(spill_dir: str, beside: Callable[[], object],
                 log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The spill disk under ``spill_dir`` as profile fields: read and write GB/s and whether they are O_DIRECT's
    (``host_probe.disk_bandwidth``), and the CPU seconds its I/O takes per GB from ``beside``, a small compute
    kernel (``disk_contention``)."""
    log(f"disk read/write in {spill_dir}: 1 GiB in 64 MiB requests (a buffer each), 4 threads, O_DIRECT where "
        "the filesystem takes it; the write timed as a rewrite; then the CPU time its I/O takes from a matmul "
        "beside it")
    read, write, direct = disk_bandwidth(spill_dir, 1 * GiB, log=log)
    contention = disk_contention.cpu_seconds_per_gb(spill_dir, direct, beside)
    return dict(disk_read_gbps=read, disk_write_gbps=write, disk_direct_faster=direct, disk_cpu_s_per_gb=contention)


def with_disk_measured(hw: HardwareProfile, disk: dict[str, Any], spill_dir: str) -> HardwareProfile:
    """``hw`` with the disk figures ``measure_disk`` gave, its source saying where and when (an earlier such
    clause, or "disk not measured", replaced); every other figure and the calibrations kept."""
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    kept = [part for part in hw.source.split("; ") if not part.startswith((MEASURED, NOT_MEASURED))]
    return hw.replace(**disk, source="; ".join(kept + [f"{MEASURED} in {spill_dir} on {when}"]))
