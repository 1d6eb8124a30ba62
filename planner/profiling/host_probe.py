"""This host's own figures, read without torch: its memory and the limits on it (cgroup, locked pages), the
spill disk's read and write speed, and whether an NVIDIA GPU is there. ``profiler`` builds the hardware
profile from them. Pure stdlib (psutil when installed).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Callable

from megatrain.planner.profiling import profile_checks
from megatrain.planner.profiling.hardware import MiB

# Bytes of one request of the disk probe: the default spill chunk (Plan.spill_chunk_bytes), what the spill backend
# reads and writes at a time (8 MiB requests read this project's disk at 1.2 GB/s with O_DIRECT, 64 MiB at 1.7).
DISK_REQUEST_BYTES = 64 * MiB


def host_memory() -> tuple[int, int, int]:
    """(total, available, cgroup limit or 0) bytes. psutil ignores cgroups, so read them too."""
    try:
        import psutil
        vm = psutil.virtual_memory()
        total, avail = int(vm.total), int(vm.available)
    except ImportError:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        total = avail = int(pages * size)
    return total, min(avail, total), cgroup_limit()


def cgroup_limit() -> int:
    """cgroup v2 memory.max or v1 memory.limit_in_bytes; 0 when unlimited or absent."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text == "max":
            return 0
        try:
            value = int(text)
        except ValueError:
            continue
        # v1 reports "unlimited" as a huge page-rounded number.
        return 0 if value >= 1 << 60 else value
    return 0


def disk_bandwidth(directory: str, nbytes: int = 1024 * MiB, threads: int = 4, request: int = DISK_REQUEST_BYTES,
                   repeats: int = 3, log: Callable[[str], None] = lambda line: None) -> tuple[float, float, bool]:
    """(read, write) GB/s of the disk under ``directory`` and whether they are O_DIRECT's: one file of ``nbytes``
    written, written again and read back in ``request``-byte requests by ``threads`` threads at once, as the spill
    backend moves its chunks. O_DIRECT where the filesystem takes it, else buffered (write + fsync; read after
    dropping the file from the page cache); plans move their spill data the same way (``Plan.io_direct``).

    O_DIRECT even where buffered transfers measure faster: the page cache copies every byte on the CPU, beside the
    step's compute and AdamW (a spilled 3.2B step on this project's 2 cores: 53.5 s reading buffered against 48.3 s
    with O_DIRECT, though the probe read buffered 1.8x faster), and holds RAM the plan counts on. The write figure
    is the second write's: a step rewrites spill files written before, and a first write into fresh extents ran at
    half that speed on this project's disk (2.7 against 5.3 GB/s, O_DIRECT, 64 MiB requests).

    Each request moves its own buffer (``nbytes`` of them in all), as the spill backend moves each chunk through
    its staging set or slot, and no two pages hold the same bytes, as no two pages of a model's state do. This
    project's disk, a virtual one, moves pages alike at half the speed or less (``benchmarks/disk_probe.py``,
    interleaved rounds, read / write GB/s): one buffer of the same bytes under every request, as this probe had,
    1.27 / 2.54; a buffer each of the same bytes 1.57 / 2.89; a buffer each, every page its own, 3.26 / 4.45;
    the spill backend moving random tensors 3.37 / 4.55.

    Each direction's best of a round of ``repeats`` passes, as every profile figure; a round whose passes (each
    timed as its read plus its write) spread beyond profile_checks.SAMPLE_SPREAD_MAX is measured again
    (``profile_checks.steadiest_round``, said through ``log``). With pages alike this project's disk read
    1.1-1.5 GB/s in six passes within a minute, and 2.4 then 3.5 GB/s in rounds three minutes apart: no round
    tells the speed an hour later, so a spilled plan's time is as true as the profile is recent."""
    direct = bool(getattr(os, "O_DIRECT", 0))

    def one_round() -> list[tuple[float, float]]:
        nonlocal direct
        passes = []
        for _ in range(repeats):
            figures = _disk_pass(directory, nbytes, threads, request, direct=direct)
            if figures is None:  # the filesystem refuses O_DIRECT
                direct = False
                figures = _disk_pass(directory, nbytes, threads, request, direct=False)
            assert figures is not None
            passes.append(figures)
        return passes

    passes = profile_checks.steadiest_round(one_round, lambda r: [1 / read + 1 / write for read, write in r],
                                            f"disk read/write in {directory}", log)
    return max(r for r, _ in passes), max(w for _, w in passes), direct


def io_buffers(count: int, nbytes: int) -> list:
    """``count`` page-aligned buffers (as O_DIRECT needs) of ``nbytes`` each, no two of their pages alike, as no
    two pages of a model's state are (see disk_bandwidth: a virtual disk can move pages alike at half the speed):
    random bytes, each page's first 8 of them its place among all the pages."""
    import mmap

    data = os.urandom(nbytes)
    bufs = [mmap.mmap(-1, nbytes) for _ in range(count)]
    for buf in bufs:
        buf.write(data)
    stamp_pages(bufs)
    return bufs


def stamp_pages(buffers: list) -> None:
    """The first 8 bytes of each 4 KiB page of ``buffers`` (equal-sized) set to its place among all of them."""
    for k, buf in enumerate(buffers):
        for page in range(0, len(buf), 4096):
            buf[page:page + 8] = (k * len(buf) + page).to_bytes(8, "little")


def _disk_pass(directory: str, nbytes: int, threads: int, block: int, direct: bool) -> tuple[float, float] | None:
    """(read, write) GB/s of one pass (see disk_bandwidth); None when O_DIRECT is refused."""
    import concurrent.futures as cf

    count = max(threads, nbytes // block)
    bufs = io_buffers(count, block)  # one per request
    fd, path = tempfile.mkstemp(prefix="megatrain-disk-", dir=directory)
    try:
        if direct:
            try:
                os.close(fd)
                fd = os.open(path, os.O_RDWR | os.O_DIRECT)
                os.pwritev(fd, [memoryview(bufs[0])[:4096]], 0)
            except OSError:
                return None

        def run(op) -> float:
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda i: op(fd, [bufs[i]], i * block), range(count)))
            return time.perf_counter() - t0

        run(os.pwritev)  # allocates the file's extents, which the spill files' steady state never does again
        os.fsync(fd)
        write_s = run(os.pwritev)
        t0 = time.perf_counter()
        os.fsync(fd)
        write_s += time.perf_counter() - t0
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        read_s = run(os.preadv)
    finally:
        os.close(fd)
        os.unlink(path)
        for buf in bufs:
            buf.close()
    done = count * block
    return done / read_s / 1e9, done / write_s / 1e9


def gpu_present() -> bool:
    """A cheap check before importing torch: an NVIDIA driver is loaded."""
    return os.path.exists("/proc/driver/nvidia/gpus") or shutil.which("nvidia-smi") is not None
