"""Host memory readings: a process's peak RSS (and its reset), and what the machine has left.

Linux only, stdlib only. Where a reading is unavailable (another OS, a sandbox that
leaves a field out) the function returns None rather than guessing.
"""
from __future__ import annotations

import os
import resource

_KIB = 1024


def _status_fields(path: str = "/proc/self/status") -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0]) * _KIB
    except OSError:
        pass
    return out


def process_memory(pid: int | None = None) -> dict[str, int | None]:
    """VmHWM (peak RSS), VmRSS, VmPin and VmLck of a process, in bytes (None where the kernel omits them)."""
    fields = _status_fields(f"/proc/{pid or 'self'}/status")
    out = {k: fields.get(k) for k in ("VmHWM", "VmRSS", "VmPin", "VmLck")}
    if out["VmHWM"] is None and pid is None:
        out["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _KIB
    return out


def reset_peak_rss() -> bool:
    """Set this process's VmHWM to its current RSS (``echo 5 > /proc/self/clear_refs``). False where the
    kernel does not support it (some sandboxes): peaks then include everything since the start."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cgroup_headroom() -> int | None:
    """Bytes left under this cgroup's memory limit (v2, then v1), or None without a limit."""
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_path) as f:
                limit = f.read().strip()
            with open(usage_path) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:
            return None
        return int(limit) - usage
    return None


def host_total() -> int | None:
    return _status_fields("/proc/meminfo").get("MemTotal")


def host_available() -> int | None:
    """Bytes the machine can still give a process: MemAvailable, or less under a cgroup limit.

    Pinned (page-locked) memory counts here as used, whether or not a process's RSS shows it.
    """
    avail = _status_fields("/proc/meminfo").get("MemAvailable")
    headroom = _cgroup_headroom()
    if avail is None:
        return headroom
    return avail if headroom is None else min(avail, headroom)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
