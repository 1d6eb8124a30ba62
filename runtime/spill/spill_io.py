"""Asynchronous file I/O for the NVMe tier: a small interface and two backends.

``PosixIO``: a bounded thread pool running ``os.preadv`` / ``os.pwritev`` (they
release the GIL), looping over short transfers; a load's reads (``first``: compute
waits for them) run before the transfers queued earlier, each kind in the order issued. Each file is opened twice: a
buffered descriptor for anything, and, where the filesystem takes it, an
``O_DIRECT`` one used for transfers whose buffer address, offset and length are
all multiples of ``SPILL_ALIGN`` (the staging buffers are allocated so). A
filesystem that refuses O_DIRECT (tmpfs, some overlays) falls back to buffered
I/O for that file, silently and correctly.

``KvikioIO``: kvikio's ``CuFile`` (GPUDirect Storage where available, its
compatibility mode otherwise). kvikio needs the CUDA driver for any I/O, even
into host buffers, so it is chosen only when ``libcuda.so.1`` loads and kvikio
imports (the ``[gds]`` extra); ``auto`` prefers it then, POSIX otherwise.

Every transfer returns a ``concurrent.futures.Future``; an ``OSError`` surfaces
from ``result()`` with the file, offset and size in its message.
"""
from __future__ import annotations

import concurrent.futures as cf
import ctypes
import errno
import itertools
import os
import queue
import threading
from typing import Callable, Protocol

import torch

from megatrain.plan.buffer_kinds import SPILL_ALIGN

from megatrain.runtime.errors import MegatrainError


class SpillError(MegatrainError):
    """The spill directory or its files cannot be used, or spill I/O failed."""


class SpillSpaceError(SpillError):
    """The disk under spill_dir has less free space than the spill files need."""


class FileIO(Protocol):
    name: str

    def open(self, path: str, nbytes: int) -> int: ...
    def read(self, handle: int, offset: int, out: torch.Tensor, first: bool = False) -> cf.Future: ...
    def write(self, handle: int, offset: int, src: torch.Tensor) -> cf.Future: ...
    def close(self) -> None: ...


class _TransferPool:
    """``threads`` threads running queued transfers: those submitted ``first`` before the rest, each kind in the
    order submitted. Bound: ``threads`` transfers at once; the queue holds what callers issued (each caller bounds
    its own: a load's chunks, the staging sets' reads and writes)."""

    def __init__(self, threads: int) -> None:
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._threads = [threading.Thread(target=self._run, name=f"megatrain-io-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, first: bool, fn: Callable[..., None], *args: object) -> cf.Future:
        future: cf.Future = cf.Future()
        self._queue.put((0 if first else 1, next(self._order), fn, args, future))
        return future

    def _run(self) -> None:
        while True:
            _, _, fn, args, future = self._queue.get()
            if fn is None:
                return
            future.set_running_or_notify_cancel()
            try:
                future.set_result(fn(*args))
            except BaseException as e:
                future.set_exception(e)

    def shutdown(self) -> None:
        """Run what is queued, then stop every thread."""
        for _ in self._threads:
            self._queue.put((2, next(self._order), None, (), None))
        for t in self._threads:
            t.join()


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uint8 host tensor of ``nbytes`` whose address is SPILL_ALIGN-aligned (for O_DIRECT)."""
    raw = torch.empty(nbytes + SPILL_ALIGN, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % SPILL_ALIGN
    return raw[shift:shift + nbytes]


def _bytes(t: torch.Tensor) -> memoryview:
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def preallocate(fd: int, nbytes: int, path: str) -> None:
    """Reserve the file's full size now, so a disk that is too small fails at start, not mid-step."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            free = os.statvfs(os.path.dirname(path) or ".")
            raise SpillSpaceError(
                f"spill file {path} needs {nbytes / 2**30:.2f} GiB but the disk has "
                f"{free.f_bavail * free.f_frsize / 2**30:.2f} GiB free; free space or choose another spill_dir"
            ) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise SpillError(f"cannot preallocate spill file {path}: {e.strerror}; check the spill_dir") from None
        os.ftruncate(fd, nbytes)  # a filesystem without fallocate: sparse, checked as it fills


def create_preallocated(path: str, nbytes: int) -> int:
    """A new spill file of ``nbytes``, reserved on disk; returns its (read-write) descriptor."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as e:
        raise SpillError(f"cannot create spill file {path}: {e.strerror}; "
                         "check spill_dir exists and is writable") from None
    try:
        preallocate(fd, nbytes, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


class PosixIO:
    name = "posix"

    def __init__(self, threads: int, direct: bool = True, direct_reads: bool | None = None) -> None:
        """``direct``: O_DIRECT writes (and reads) where the filesystem takes it; ``direct_reads``: reads apart
        (None: as ``direct``). A read after an O_DIRECT write of the same range is coherent: the write drops the
        range from the page cache."""
        # Bound: ``threads`` transfers run at once; the rest wait in the pool's queue.
        self._pool = _TransferPool(threads)
        self._direct_writes = direct
        self._direct_reads = direct if direct_reads is None else direct_reads
        self._want_direct = self._direct_writes or self._direct_reads
        self._fds: list[tuple[int, int | None, str]] = []  # (buffered fd, direct fd or None, path)

    def open(self, path: str, nbytes: int) -> int:
        fd = create_preallocated(path, nbytes)
        direct = self._open_direct(path) if self._want_direct else None
        self._fds.append((fd, direct, path))
        return len(self._fds) - 1

    def _open_direct(self, path: str) -> int | None:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None
        try:
            fd = os.open(path, os.O_RDWR | flag)
        except OSError:
            return None
        probe = aligned_empty(SPILL_ALIGN)
        try:  # some filesystems accept the flag at open and refuse the transfer
            os.preadv(fd, [_bytes(probe)], 0)
        except OSError:
            os.close(fd)
            return None
        return fd

    @property
    def direct(self) -> bool:
        return any(d is not None for _, d, _ in self._fds)

    def _fd_for(self, handle: int, offset: int, t: torch.Tensor, write: bool) -> int:
        fd, direct, _ = self._fds[handle]
        nbytes = t.numel() * t.element_size()
        wanted = self._direct_writes if write else self._direct_reads
        if wanted and direct is not None and offset % SPILL_ALIGN == 0 and nbytes % SPILL_ALIGN == 0 \
                and t.data_ptr() % SPILL_ALIGN == 0:
            return direct
        return fd

    def read(self, handle: int, offset: int, out: torch.Tensor, first: bool = False) -> cf.Future:
        return self._pool.submit(first, self._transfer, os.preadv, handle, offset, out)

    def write(self, handle: int, offset: int, src: torch.Tensor) -> cf.Future:
        return self._pool.submit(False, self._transfer, os.pwritev, handle, offset, src)

    def _transfer(self, op, handle: int, offset: int, t: torch.Tensor) -> None:
        fd = self._fd_for(handle, offset, t, write=op is os.pwritev)
        view = _bytes(t)
        done = 0
        while done < len(view):
            try:
                n = op(fd, [view[done:]], offset + done)
            except OSError as e:
                raise SpillError(
                    f"spill {'read' if op is os.preadv else 'write'} failed on {self._fds[handle][2]} at byte "
                    f"{offset + done} ({len(view) - done} bytes): {e.strerror}"
                ) from None
            if n == 0:
                raise SpillError(f"spill read hit the end of {self._fds[handle][2]} at byte {offset + done}; "
                                 "the file was truncated")
            done += n

    def close(self) -> None:
        self._pool.shutdown()
        for fd, direct, _ in self._fds:
            os.close(fd)
            if direct is not None:
                os.close(direct)
        self._fds.clear()


class KvikioIO:
    """kvikio CuFile I/O. Not exercised without a CUDA driver (CI has none)."""

    name = "kvikio"

    def __init__(self, threads: int) -> None:
        import kvikio  # noqa: F401  (the [gds] extra)
        import kvikio.defaults

        kvikio.defaults.set("num_threads", threads)
        self._kvikio = kvikio
        # Waits on kvikio's own futures off the caller's thread; kvikio's pool does the transfers.
        self._waiters = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="megatrain-kvikio")
        self._files: list[tuple[object, str]] = []

    def open(self, path: str, nbytes: int) -> int:
        fd = create_preallocated(path, nbytes)
        os.close(fd)
        self._files.append((self._kvikio.CuFile(path, "r+"), path))
        return len(self._files) - 1

    def _submit(self, method: str, handle: int, offset: int, t: torch.Tensor) -> cf.Future:
        f, path = self._files[handle]
        buf = t.view(torch.uint8).numpy()
        io_future = getattr(f, method)(buf, buf.nbytes, offset)

        def wait() -> None:
            try:
                done = io_future.get()
            except OSError as e:
                raise SpillError(f"spill {method} failed on {path} at byte {offset}: {e.strerror or e}") from None
            if done != buf.nbytes:
                raise SpillError(f"spill {method} on {path} at byte {offset} moved {done} of {buf.nbytes} bytes")
        return self._waiters.submit(wait)

    def read(self, handle: int, offset: int, out: torch.Tensor, first: bool = False) -> cf.Future:
        return self._submit("pread", handle, offset, out)  # kvikio's own pool orders its transfers

    def write(self, handle: int, offset: int, src: torch.Tensor) -> cf.Future:
        return self._submit("pwrite", handle, offset, src)

    def close(self) -> None:
        self._waiters.shutdown(wait=True)
        for f, _ in self._files:
            f.close()  # type: ignore[attr-defined]
        self._files.clear()


def cuda_driver_present() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def make_io(backend: str, threads: int, direct: bool = True, direct_reads: bool | None = None) -> FileIO:
    """``auto``: kvikio when it imports and the CUDA driver loads, else POSIX (O_DIRECT where the
    filesystem takes it when ``direct``, else buffered; reads apart when ``direct_reads`` is not None)."""
    if backend in ("auto", "kvikio"):
        usable = cuda_driver_present()
        if usable:
            try:
                return KvikioIO(threads)
            except ImportError:
                usable = False
        if backend == "kvikio":
            raise SpillError("io_backend='kvikio' needs the CUDA driver (libcuda.so.1) and "
                             "`pip install megatrain[gds]`; use io_backend='posix'")
    return PosixIO(threads, direct, direct_reads)
