"""A disk that fails under a command (full, over quota, a device error): its own exit status and one line.

A bad path or a refused input is the user's to fix in the command (status 2); a disk that fills up or fails while
the command writes is not, and a script or a scheduler that requeues runs tells the two apart by the status:
``EXIT_IO`` (74, ``EX_IOERR`` of sysexits.h). The line names the file and what to do.
"""
from __future__ import annotations

import errno

EXIT_IO = 74
EXIT_USAGE = 2
# The errors of the disk itself, not of the path: out of space or quota, a file too large, a failing device.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def exit_status(e: OSError) -> int:
    """``EXIT_IO`` for a failing disk, ``EXIT_USAGE`` for the rest (a path that is wrong, not writable, gone)."""
    return EXIT_IO if e.errno in DISK_ERRNOS else EXIT_USAGE


def line(e: OSError) -> str:
    """One line: the file, the system's words and what to do."""
    where = f"{e.filename}: " if e.filename else ""
    fix = "free space (or fix the disk) and run again" if e.errno in DISK_ERRNOS else "check the path and the disk"
    return f"{where}{e.strerror or e}; {fix}"
