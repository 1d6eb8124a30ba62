"""This host's own figures, read without torch: its memory and the limits on it (cgroup, locked pages), the
spill disk's read and write speed, and whether an NVIDIA GPU is there. ``profiler`` builds the hardware
profile from them. Pure stdlib (psutil when installed).
"""
from __future__ import annotations

import os
import resource
import shutil
import tempfile
import time

from .hardware import MiB

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


def memlock_bytes() -> int:
    """RLIMIT_MEMLOCK soft limit in bytes; -1 when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return -1 if soft == resource.RLIM_INFINITY else int(soft)


def disk_bandwidth(directory: str, nbytes: int = 1024 * MiB, threads: int = 4,
                   request: int = DISK_REQUEST_BYTES) -> tuple[float, float, bool | None]:
    """(read, write) GB/s of the disk under ``directory`` and whether O_DIRECT was the faster way: one file of
    ``nbytes`` written and read back in ``request``-byte requests by ``threads`` threads at once, as the spill
    backend moves its chunks, buffered (write + fsync; read after dropping the file from the page cache) and with
    O_DIRECT where the filesystem takes it. The figures are the faster mode's (by the sum of both directions), as
    the plan then runs both directions (``Plan.io_direct``)."""
    buffered = _disk_pass(directory, nbytes, threads, request, direct=False)
    direct = _disk_pass(directory, nbytes, threads, request, direct=True) if getattr(os, "O_DIRECT", 0) else None
    if direct is None:
        return buffered[0], buffered[1], None
    faster = direct[0] + direct[1] > buffered[0] + buffered[1]
    best = direct if faster else buffered
    return best[0], best[1], faster


def _disk_pass(directory: str, nbytes: int, threads: int, block: int, direct: bool) -> tuple[float, float] | None:
    """(read, write) GB/s of one pass (see disk_bandwidth); None when O_DIRECT is refused."""
    import concurrent.futures as cf
    import mmap

    count = max(threads, nbytes // block)
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(block))
    fd, path = tempfile.mkstemp(prefix="megatrain-disk-", dir=directory)
    try:
        if direct:
            try:
                os.close(fd)
                fd = os.open(path, os.O_RDWR | os.O_DIRECT)
                os.pwritev(fd, [memoryview(buf)[:4096]], 0)
            except OSError:
                return None

        def run(op) -> float:
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda i: op(fd, [buf], i * block), range(count)))
            return time.perf_counter() - t0

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
        buf.close()
    done = count * block
    return done / read_s / 1e9, done / write_s / 1e9


def gpu_present() -> bool:
    """A cheap check before importing torch: an NVIDIA driver is loaded."""
    return os.path.exists("/proc/driver/nvidia/gpus") or shutil.which("nvidia-smi") is not None
