"""Training checkpoints: the full state in tensorstore arrays, committed atomically, written in the background.

[Note: checkpoint commit protocol]
A checkpoint of optimizer step N is the directory ``<dir>/step-<N:08d>``. It is
written as ``step-<N>.tmp``: three zarr v3 arrays (tensorstore, sharded, raw
``bytes`` codec) each fsynced, then ``manifest.json`` (everything else, plus the
CRC32 of each array and the size of every file), fsynced, then the directory
is renamed to ``step-<N>`` and the parent fsynced; then ``<dir>/latest`` (one
line, the step directory's name) is replaced atomically (write ``latest.tmp``,
fsync, ``os.replace``, fsync the parent). Finally all but the newest ``keep``
complete step directories are renamed to ``*.tmp`` and removed. A reader
ignores every ``*.tmp`` and every directory without a manifest, so a crash at
any moment leaves the previous checkpoint loadable and the new one either
complete or ignored. One writer per directory at a time.

Re-saving a step that already has a complete directory (a save right after
loading it) never removes the old copy before the new one is reachable: the new
one is renamed to ``step-<N>.resave`` (complete, visible to readers), ``latest``
is pointed at it, the old ``step-<N>`` goes, the new one is renamed to
``step-<N>`` and ``latest`` pointed back. A reader whose ``latest`` names one
of the two spellings that is gone takes the other. A crash anywhere in between
leaves a loadable step N; the next save first finishes an interrupted switch
(the ``.resave`` copy is the newer), so its ``*.tmp`` clean-up never holds the
only copy.

[Note: failed checkpoint writes]
A failed write removes its ``step-<N>.tmp`` and leaves the previous checkpoint
as it was. Its error (one line; a full disk says how much space the
checkpoint needs) is reported once: raised by ``handle.wait()`` /
``wait_for_checkpoint()``, or, if nobody waited, warned by the next save,
which then goes ahead. A later save works once the cause is gone.

[Note: asynchronous checkpoints]
``save_checkpoint(blocking=False)`` waits for queued AdamW updates, copies the
master, exp_avg and exp_avg_sq arenas into a snapshot (memcpy speed; this copy
is the whole stall training sees) and returns; a background thread writes the
snapshot and commits. Cost: while a write is in flight the snapshot holds
12 bytes per parameter of extra host RAM (freed when the write ends), and at
most one write is in flight (a second save waits for the first: that is the
bound). ``blocking=True`` writes straight from the live arenas: no extra RAM,
training waits for the whole write.

[Note: checkpoint I/O speed]
Measured (80M parameters, 0.96 GB, 2-core VM; page cache dropped): the first
release read at 0.3-0.65 GB/s against 2.6-4.2 GB/s for a plain ``readinto``.
A whole-array tensorstore read (or write) of a sharded array holds every shard
it touches at once (one extra copy of the array: +1 GiB peak for a 1 GiB array)
at ~0.8 GB/s even from the page cache; read one inner chunk at a time it does
2.5-4 GB/s, but still copies each chunk through its own buffer, and the CRC32
pass (zlib, ~3.5 GB/s on one core) ran after the read. So:

* Reads: for exactly the layout ``_spec`` writes (checked field by field in
  ``zarr.json``; anything else goes through tensorstore, in the same pieces)
  each 4 MiB inner chunk is ``preadv``-ed from its shard file (offset from the
  shard's index) straight into the destination, and a worker thread computes
  its CRC32 while the next chunk is read. Same bytes, same format, one copy:
  2.3-3.1 GB/s. The manifest's CRC32s are still verified over the destination:
  a bad index or chunk is a checksum error or a one-line "cannot read" error.
* Writes: tensorstore, one shard (``write_chunk``, up to 256 MiB) at a time,
  its CRC32 computed while tensorstore encodes it (a spilled kind's blocks are
  gathered into whole shards: no shard is rewritten); the arrays one after
  another, each fsynced in the background while the next is encoded. Write
  speed is the disk's (fsync), as for a plain write.

Extra RAM: one shard while writing (two for a spilled kind), a few 4 MiB chunks
while reading (plus one block for a spilled kind).

Only JSON and the arrays' raw little-endian float32 chunks are read back (by
tensorstore or directly): no pickle.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import errno
import functools
import json
import math
import os
import re
import shutil
import threading
import time
import warnings
import zlib
from typing import Iterator, TYPE_CHECKING, Any, Mapping

import numpy as np
import torch

from megatrain.planner.plan import Plan

from .config import ModelConfig, OptimizerConfig
from .errors import CheckpointError, ConfigError, InputError, MegatrainError
from .paths import user_path

if TYPE_CHECKING:
    from .engine import Engine

FORMAT = "megatrain-checkpoint"
VERSION = 1
ARRAYS = ("master", "exp_avg", "exp_avg_sq")
MANIFEST = "manifest.json"
LATEST = "latest"
CRC_CHUNK_BYTES = 64 * 2**20  # one CRC32 per 64 MiB of an array: names the corrupt range, cheap to verify
READ_PIECE_BYTES = 4 * 2**20  # reads move whole inner chunks of at least this many bytes...
READS_IN_FLIGHT = 2  # ...this many at a time (the CRC of one while the next is read)
RESAVE = ".resave"  # a re-saved step's new copy while it replaces the old one
_STEP_DIR = re.compile(r"step-(\d+)(?:\.resave)?")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


# ---------------------------------------------------------------------- writing
class CheckpointHandle:
    """One save in progress or done. ``wait()`` returns the committed directory or raises the writer's error."""

    def __init__(self, path: str) -> None:
        self.path = path  # the directory the checkpoint has once committed
        self.stall_s = 0.0  # how long save_checkpoint held the caller
        self.write_s = 0.0  # how long the write and commit took (background or not)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._reported = False

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> str:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.path

    def _report_unwaited(self, then: str) -> None:
        """Warn once about a failed write nobody waited for (see [Note: failed checkpoint writes])."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None and not self._reported:
            self._reported = True
            warnings.warn(f"{_one_line(self._error)}; {then}", RuntimeWarning, stacklevel=4)

    def _join_quietly(self) -> None:
        self._report_unwaited("nothing was saved")


class CheckpointWriter:
    """At most one checkpoint in flight per engine (the snapshot bound: 12 B/param of host RAM)."""

    def __init__(self) -> None:
        self.last: CheckpointHandle | None = None

    def wait(self) -> str | None:
        """The last save's committed directory; its error raised once (None afterwards, and with no save)."""
        last = self.last
        if last is None or (last._reported and last.done() and last._error is not None):
            return None
        return last.wait()

    def save(self, engine: "Engine", directory: str | os.PathLike, extra: Mapping[str, Any] | None,
             keep: int, blocking: bool) -> CheckpointHandle:
        start = time.perf_counter()
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ConfigError(f"keep={keep!r} must be an integer >= 1 (complete checkpoints to keep)")
        extra = _check_extra(extra)
        directory = _make_directory(directory)
        step = engine.step_count
        if self.last is not None:  # the previous write first (one snapshot at a time); its failure reported once
            self.last._report_unwaited(f"saving step {step} now")
        engine.synchronize()
        manifest = _engine_manifest(engine, step, extra)
        store = engine.store
        live = {kind: SpilledArena(store, kind) if kind in store.spilled else store._arena(kind).tensor
                for kind in ("master", "exp_avg", "exp_avg_sq")}
        handle = CheckpointHandle(os.path.join(directory, f"step-{step:08d}"))
        self.last = handle
        # With spilled state there is no RAM to snapshot into: write it now, block by block, from the files.
        if blocking or store.spilled:
            _commit(handle, directory, step, live, manifest, keep)
            handle.stall_s = time.perf_counter() - start
            handle.wait()
            return handle
        snapshot = {name: t.clone() for name, t in live.items()}  # the stall: memcpy of master, m and v
        handle._thread = threading.Thread(target=_commit, args=(handle, directory, step, snapshot, manifest, keep),
                                          name="megatrain-checkpoint", daemon=False)
        handle._thread.start()
        handle.stall_s = time.perf_counter() - start
        return handle


class SpilledArena:
    """A spilled kind as a checkpoint array: the arena's bytes in block order, one block in RAM at a time."""

    def __init__(self, store: Any, kind: str) -> None:
        self.store, self.kind = store, kind

    def numel(self) -> int:
        return self.store.total_numel

    def pieces(self) -> Iterator[tuple[int, torch.Tensor]]:
        for b in range(len(self.store.numels)):
            yield self.store.offsets[b], self.store.read_block(self.kind, b)


def _shards(t: "torch.Tensor | SpilledArena", step: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(offset, piece) covering t in order, each piece one whole shard of ``step`` elements (the last may be short).

    In RAM the pieces are views; a spilled kind's blocks are gathered into one reused shard-sized buffer, so
    tensorstore never re-reads and rewrites a shard that a block boundary splits."""
    n = t.numel()
    if not isinstance(t, SpilledArena):
        for lo in range(0, n, step):
            yield lo, t[lo:lo + step]
        return
    buf = torch.empty(min(step, n), dtype=torch.float32)
    start, filled = 0, 0
    for _, block in t.pieces():
        i = 0
        while i < block.numel():
            take = min(buf.numel() - filled, block.numel() - i)
            buf[filled:filled + take].copy_(block[i:i + take])
            filled, i = filled + take, i + take
            if filled == buf.numel() or start + filled == n:
                yield start, buf[:filled]  # the caller is done with it before asking for the next
                start, filled = start + filled, 0


class _Crc32s:
    """CRC32 of each CRC_CHUNK_BYTES of a byte stream fed in order, piece by piece (zlib releases the GIL)."""

    def __init__(self) -> None:
        self.crcs: list[int] = []
        self.current, self.filled = 0, 0

    def update(self, piece: torch.Tensor) -> None:
        raw = memoryview(piece.view(torch.uint8).numpy())  # pieces are contiguous: no copy
        i = 0
        while i < len(raw):
            take = min(CRC_CHUNK_BYTES - self.filled, len(raw) - i)
            self.current = zlib.crc32(raw[i:i + take], self.current)
            self.filled, i = self.filled + take, i + take
            if self.filled == CRC_CHUNK_BYTES:
                self.crcs.append(self.current)
                self.current, self.filled = 0, 0

    def digest(self) -> list[int]:
        return self.crcs + ([self.current] if self.filled else [])


def _check_extra(extra: Mapping[str, Any] | None) -> Any:
    if extra is None:
        return {}
    try:
        return json.loads(json.dumps(extra, allow_nan=False))  # a deep copy the caller cannot mutate any more
    except (TypeError, ValueError) as e:
        raise InputError(f"extra is not JSON-serialisable ({e}); pass plain dicts, lists, str, int, finite float") from None


def _engine_manifest(engine: "Engine", step: int, extra: Any) -> dict[str, Any]:
    store = engine.store
    opt = engine.optimizer
    return {
        "format": FORMAT, "version": VERSION, "step": step,
        "engine": {
            "model_config": engine.config.to_dict(),
            "optimizer": {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay,
                          "max_grad_norm": opt.max_grad_norm, "no_decay": list(opt.no_decay),
                          "skip_nonfinite": opt.skip_nonfinite},
            "plan": engine.plan.to_dict(),
            "compute_dtype": _DTYPE_NAMES[engine.compute_dtype],
            "seed": engine.seed,
            "step_count": step,
            "block_steps": [float(s) for s in store.steps],  # AdamW step per block (float32, exact in JSON)
            "hf_config": engine.hf_config,
        },
        "extra": extra,
        "blocks": [{"offset": store.offsets[b.index], "numel": b.layout.numel} for b in engine.templates.blocks],
        "tensors": _tensor_table(engine),
    }


def _tensor_table(engine: "Engine") -> dict[str, dict[str, Any]]:
    """Where each Hugging Face-named parameter lives in the flat arrays (element offset, shape)."""
    return {e.hf_name: {"offset": engine.store.offsets[b.index] + e.offset, "shape": list(e.shape)}
            for b in engine.templates.blocks for e in b.layout.entries}


def _spec(path: str, numel: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": {"driver": "file", "path": path},
                            "context": {"file_io_sync": False}}  # we fsync every file ourselves, once
    if numel is not None:
        inner = min(numel, 2**20)  # 4 MiB chunks inside shards of up to 256 MiB
        outer = min(-(-numel // inner) * inner, 2**26)
        spec.update(create=True, delete_existing=True, metadata={
            "shape": [numel], "data_type": "float32",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [outer]}},
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": [inner],
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]}}]})
    return spec


def _write_array(arr: Any, t: "torch.Tensor | SpilledArena") -> list[int]:
    """Write t into the tensorstore array one shard at a time; its CRC32s, computed while tensorstore writes."""
    crc = _Crc32s()
    for lo, piece in _shards(t, arr.chunk_layout.write_chunk.shape[0]):
        pending = arr[lo:lo + piece.numel()].write(piece.numpy())
        crc.update(piece)
        pending.result()
    return crc.digest()


def _fsync_tree(path: str) -> None:
    for root, _, names in os.walk(path):
        for n in names:
            _fsync_file(os.path.join(root, n))


def _commit(handle: CheckpointHandle, directory: str, step: int, arrays: dict[str, torch.Tensor],
            manifest: dict[str, Any], keep: int) -> None:
    """Write, fsync, manifest, rename, latest, prune (see [Note: checkpoint commit protocol])."""
    import tensorstore as ts

    start = time.perf_counter()
    final = handle.path
    tmp = final + ".tmp"
    made_tmp = False
    try:
        _finish_interrupted_resaves(directory)  # first: afterwards no *.tmp can be the only copy of a step
        for name in os.listdir(directory):  # leftovers of crashed writes (one writer per directory)
            if name.endswith(".tmp") and os.path.isdir(os.path.join(directory, name)):
                shutil.rmtree(os.path.join(directory, name))
        os.makedirs(tmp)
        made_tmp = True
        manifest["arrays"] = {}
        with cf.ThreadPoolExecutor(1, thread_name_prefix="megatrain-checkpoint-fsync") as fsyncs:
            flushed = []
            for name, t in arrays.items():  # one after another: each one's writeback overlaps the next's encoding
                arr = ts.open(_spec(os.path.join(tmp, name), t.numel())).result()
                manifest["arrays"][name] = {"path": name, "dtype": "float32", "shape": [t.numel()],
                                            "crc32_chunk_bytes": CRC_CHUNK_BYTES, "crc32": _write_array(arr, t)}
                del arr
                flushed.append(fsyncs.submit(_fsync_tree, os.path.join(tmp, name)))
            for f in flushed:
                f.result()
        files = {}  # every file fsynced again (clean by now: cheap), every directory, the sizes
        for root, dirs, names in os.walk(tmp):
            for n in names:
                full = os.path.join(root, n)
                _fsync_file(full)
                files[os.path.relpath(full, tmp).replace(os.sep, "/")] = os.path.getsize(full)
            for d in dirs:
                _fsync_dir(os.path.join(root, d))
        manifest["files"] = dict(sorted(files.items()))
        _write_durably(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1, allow_nan=False) + "\n")
        _fsync_dir(tmp)
        made_tmp = False  # complete from here on: never removed as a failed write
        if _is_complete(final):  # re-saving a step (e.g. after loading it): the old copy stays until the switch
            os.rename(tmp, final + RESAVE)
            _fsync_dir(directory)
            _switch_resave(directory, os.path.basename(final))
        else:
            if os.path.lexists(final):  # an incomplete directory under the final name: never a checkpoint
                _remove(directory, os.path.basename(final))
            os.rename(tmp, final)
            _fsync_dir(directory)
            _point_latest(directory, os.path.basename(final))
    except BaseException as e:
        if made_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        handle._error = _write_error(e, directory, final, arrays) if isinstance(e, Exception) else e
        handle.write_s = time.perf_counter() - start
        return
    try:  # committed: an error from here on concerns only the older checkpoints beyond ``keep``
        _prune(directory, os.path.basename(final), keep)
    except BaseException as e:
        reason = (e.strerror or str(e)) if isinstance(e, OSError) else _one_line(e)
        handle._error = e if not isinstance(e, Exception) else CheckpointError(
            f"checkpoint {final} is saved, but removing older ones beyond keep={keep} failed ({reason}); "
            "remove them by hand")
    finally:
        handle.write_s = time.perf_counter() - start


def _is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def _point_latest(directory: str, name: str) -> None:
    """``latest`` names ``name``, atomically and durably."""
    _write_durably(os.path.join(directory, LATEST + ".tmp"), name + "\n")
    os.replace(os.path.join(directory, LATEST + ".tmp"), os.path.join(directory, LATEST))
    _fsync_dir(directory)


def _remove(directory: str, name: str) -> None:
    """Remove a step directory: renamed to ``*.tmp`` first, so readers never see it half deleted."""
    doomed = os.path.join(directory, name + ".deleting.tmp")
    os.rename(os.path.join(directory, name), doomed)
    _fsync_dir(directory)
    shutil.rmtree(doomed)


def _switch_resave(directory: str, name: str) -> None:
    """``name + RESAVE`` (complete, the newer copy of the step) replaces ``name``; at every moment one of the two
    is complete and ``latest`` names it or the other spelling (see [Note: checkpoint commit protocol])."""
    _point_latest(directory, name + RESAVE)
    if os.path.lexists(os.path.join(directory, name)):
        _remove(directory, name)
    os.rename(os.path.join(directory, name + RESAVE), os.path.join(directory, name))
    _fsync_dir(directory)
    _point_latest(directory, name)


def _finish_interrupted_resaves(directory: str) -> None:
    """A crash during a re-save leaves a complete ``step-<N>.resave``: it is the newer copy, so it takes over."""
    for entry in sorted(os.listdir(directory)):
        if entry.endswith(RESAVE) and _STEP_DIR.fullmatch(entry):
            if _is_complete(os.path.join(directory, entry)):
                _switch_resave(directory, entry[:-len(RESAVE)])
            else:
                _remove(directory, entry)


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0][:300] if lines else type(err).__name__


def _write_error(err: Exception, directory: str, final: str, arrays: Mapping[str, Any]) -> Exception:
    """A failed checkpoint write as one line: the directory, and for a full disk the space the checkpoint needs."""
    if isinstance(err, MegatrainError):
        return err
    text = str(err)
    full = (isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)) or \
        "RESOURCE_EXHAUSTED" in text or "No space left" in text or "Disk quota exceeded" in text
    where = getattr(err, "filename", None) or final
    if full:
        need = sum(t.numel() for t in arrays.values()) * 4
        try:
            free = f"{_size(shutil.disk_usage(directory).free)} free"
        except OSError:
            free = "free space unknown"
        return CheckpointError(f"cannot write checkpoint {where}: the disk is full (the checkpoint needs "
                               f"{_size(need)}, {free} in {directory}); free space or save elsewhere "
                               "(the previous checkpoint is untouched)")
    reason = err.strerror if isinstance(err, OSError) and err.strerror else _one_line(err)
    return CheckpointError(f"cannot write checkpoint {where}: {reason}; check the directory "
                           "(the previous checkpoint is untouched)")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _make_directory(directory: Any) -> str:
    """The checkpoint directory, created if needed; one line if it cannot be."""
    path = user_path(directory, "directory")
    try:
        os.makedirs(path, exist_ok=True)
    except (OSError, ValueError) as e:
        reason = getattr(e, "strerror", None) or _one_line(e)
        raise CheckpointError(f"cannot create the checkpoint directory {path}: {reason}; choose a writable "
                              "directory") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write in the checkpoint directory {path}; choose a writable directory")
    return path


def _prune(directory: str, newest: str, keep: int) -> None:
    complete = [(step, name) for step, name in _complete(directory) if name != newest]
    for _, name in complete[:max(0, len(complete) - (keep - 1))]:
        _remove(directory, name)  # invisible to readers before any file goes


def _complete(directory: str) -> list[tuple[int, str]]:
    """(step, name) of the complete step directories, oldest first."""
    return sorted((int(m.group(1)), name) for name in os.listdir(directory)
                  if (m := _STEP_DIR.fullmatch(name)) and os.path.isfile(os.path.join(directory, name, MANIFEST)))


def _write_durably(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    _fsync_file(path)


# ---------------------------------------------------------------------- reading
def resolve(directory: str | os.PathLike) -> str:
    """The complete step directory to load: ``directory`` itself, the one ``latest`` names, or the newest complete."""
    directory = user_path(directory, "directory")
    if os.path.isfile(os.path.join(directory, MANIFEST)):
        if directory.rstrip("/").endswith(".tmp"):
            raise InputError(f"{directory} is an unfinished checkpoint (*.tmp); load its parent directory instead")
        return directory
    if not os.path.isdir(directory):
        raise InputError(f"no checkpoint directory at {directory}; pass the directory save_checkpoint wrote")
    latest = os.path.join(directory, LATEST)
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as f:
            name = f.read().strip()
        if _STEP_DIR.fullmatch(name):  # mid-switch of a re-save, the other spelling is the complete one
            other = name[:-len(RESAVE)] if name.endswith(RESAVE) else name + RESAVE
            for candidate in (name, other):
                if os.path.isfile(os.path.join(directory, candidate, MANIFEST)):
                    return os.path.join(directory, candidate)
    complete = _complete(directory)
    if not complete:
        raise InputError(f"no complete checkpoint in {directory} (a step-<N> directory with {MANIFEST}); "
                         "pass the directory save_checkpoint wrote")
    return os.path.join(directory, complete[-1][1])


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of a complete step directory, with every file checked present at its recorded size."""
    mpath = os.path.join(path, MANIFEST)
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
        if manifest.get("format") != FORMAT:
            raise InputError(f"{mpath} is not a megatrain checkpoint manifest; pass a directory save_checkpoint wrote")
        if manifest.get("version") != VERSION:
            raise InputError(f"{mpath} has checkpoint version {manifest.get('version')}; this megatrain reads "
                             f"version {VERSION}: load it with the megatrain that wrote it")
        files = dict(manifest["files"])
        for name in ARRAYS:
            manifest["arrays"][name]["crc32"]
        manifest["engine"]["model_config"]
        counts = [manifest["engine"]["step_count"], *manifest["engine"]["block_steps"]]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        raise InputError(f"{mpath} is corrupt or truncated; load the previous step directory instead") from None
    bad = [c for c in counts if not (isinstance(c, (int, float)) and not isinstance(c, bool)
                                     and math.isfinite(c) and c >= 0 and c == int(c))]
    if bad:
        raise InputError(f"{mpath} holds the step count {bad[0]!r} (optimizer steps are whole numbers >= 0): the "
                         "manifest is corrupt; load the previous step directory instead")
    if not all(isinstance(rel, str) and type(size) is int for rel, size in files.items()):
        raise InputError(f"{mpath} lists its files wrongly: the manifest is corrupt; load the previous step "
                         "directory instead")
    for rel, size in files.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise InputError(f"{full} is missing from the checkpoint; load the previous step directory instead")
        actual = os.path.getsize(full)
        if actual != size:
            raise InputError(f"{full} has {actual} bytes, the manifest says {size}: the checkpoint is truncated or "
                             "corrupt; load the previous step directory instead")
    return manifest


def engine_arguments(manifest: dict[str, Any]) -> dict[str, Any]:
    """Engine(...) keyword arguments recorded in a manifest."""
    e = manifest["engine"]
    try:
        opt = dict(e["optimizer"])
        opt["betas"], opt["no_decay"] = tuple(opt["betas"]), tuple(opt["no_decay"])
        return {"model_config": ModelConfig(**e["model_config"]), "optimizer": OptimizerConfig(**opt),
                "plan": Plan.from_dict(e["plan"]), "seed": e["seed"],
                "compute_dtype": {v: k for k, v in _DTYPE_NAMES.items()}[e["compute_dtype"]]}
    except (KeyError, TypeError) as err:
        raise InputError(f"the checkpoint manifest's engine section is invalid ({err}); "
                         "load it with the megatrain that wrote it") from None


def _read_into(src: Any, lo: int, dst: torch.Tensor, crc: _Crc32s) -> None:
    """``src[lo:lo + dst.numel()]`` into dst, in pieces of whole inner chunks, READS_IN_FLIGHT at a time; the CRC32s
    of the bytes that landed in dst fed to crc in order, each while the next pieces are read."""
    import tensorstore as ts

    chunk = src.chunk_layout.read_chunk.shape[0] or 1
    step = chunk * max(1, READ_PIECE_BYTES // (4 * chunk))
    n = dst.numel()
    target = ts.array(dst.numpy(), copy=False, write=True)
    inflight: collections.deque = collections.deque()
    try:
        a = 0
        while a < n or inflight:
            if a < n and len(inflight) < READS_IN_FLIGHT:
                b = min(n, ((lo + a) // step + 1) * step - lo)  # piece ends on a chunk boundary of src
                inflight.append((a, b, target[a:b].write(src[lo + a:lo + b])))
                a = b
                continue
            pa, pb, pending = inflight.popleft()
            pending.result()
            crc.update(dst[pa:pb])
    finally:
        for _, _, pending in inflight:  # after an error: nothing may still be writing into dst
            try:
                pending.result()
            except Exception:
                pass


MISSING_CHUNK = 2**64 - 1  # a shard index entry (offset, nbytes) of a chunk never stored: all fill value


def _direct_layout(path: str) -> tuple[int, int, int] | None:
    """(numel, elements per shard, per inner chunk) where ``path/zarr.json`` describes exactly the layout ``_spec``
    writes (1-d float32, fill 0, shards of raw little-endian inner chunks, the index at the end); else None."""
    try:
        with open(os.path.join(path, "zarr.json"), encoding="utf-8") as f:
            meta = json.load(f)
        (numel,) = meta["shape"]
        (outer,) = meta["chunk_grid"]["configuration"]["chunk_shape"]
        (codec,) = meta["codecs"]
        config = dict(codec["configuration"])
        (inner,) = config["chunk_shape"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # tensorstore reads it, or says what is wrong
    if not all(type(v) is int and v > 0 for v in (numel, outer, inner)) or outer % inner:
        return None
    fill = meta.get("fill_value")
    if type(fill) not in (int, float) or fill != 0 or str(fill).startswith("-"):  # +0.0: zeros, bit for bit
        return None
    meta["fill_value"] = 0.0
    if meta.get("attributes", {}) == {}:
        meta.pop("attributes", None)
    if meta.get("dimension_names", [None]) == [None]:
        meta.pop("dimension_names", None)
    if config.get("index_location", "end") == "end":
        config.pop("index_location", None)
    if meta.get("chunk_key_encoding") == {"name": "default", "configuration": {"separator": "/"}}:
        meta["chunk_key_encoding"] = {"name": "default"}
    expected = {"zarr_format": 3, "node_type": "array", "shape": [numel], "data_type": "float32", "fill_value": 0.0,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [outer]}},
                "chunk_key_encoding": {"name": "default"},
                "codecs": [{"name": "sharding_indexed", "configuration": {}}]}
    wanted = _spec(path, numel)["metadata"]["codecs"][0]["configuration"]
    if {**meta, "codecs": [{**codec, "configuration": {}}]} != expected or \
            {**config, "chunk_shape": None} != {**wanted, "chunk_shape": None}:
        return None
    return numel, outer, inner


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise ValueError(f"the file ends at byte {offset + got}, inside a chunk")
        got += n


def _read_direct(path: str, layout: tuple[int, int, int], lo: int, dst: torch.Tensor, crc: _Crc32s,
                 crc_worker: cf.Executor) -> None:
    """``[lo, lo + dst.numel())`` of the array at path into dst: one ``preadv`` per inner chunk from its shard file
    (what tensorstore reads, without its intermediate buffer); each chunk's CRC32s computed by crc_worker (one
    thread, in order) while the next is read. A missing chunk or shard file is the fill value, zeros."""
    _, outer, inner = layout
    per_shard = outer // inner
    index_bytes = 16 * per_shard + 4  # (offset, nbytes) little-endian uint64 per inner chunk, then its crc32c
    raw = memoryview(dst.view(torch.uint8).numpy())
    pending = []
    try:
        pos, end = lo, lo + dst.numel()
        while pos < end:
            shard = pos // outer
            shard_end = min(end, (shard + 1) * outer)
            try:
                fd = os.open(os.path.join(path, "c", str(shard)), os.O_RDONLY)
            except FileNotFoundError:
                fd = -1  # tensorstore writes no shard that is all fill value (the manifest lists every file)
            try:
                if fd >= 0:
                    data_bytes = os.fstat(fd).st_size - index_bytes
                    if data_bytes < 0:
                        raise ValueError(f"shard {shard} is shorter than its index")
                    index = bytearray(index_bytes)
                    _pread_into(fd, memoryview(index), data_bytes)
                    entries = np.frombuffer(index, dtype="<u8", count=2 * per_shard).reshape(per_shard, 2)
                while pos < shard_end:
                    k = pos // inner - shard * per_shard
                    stop = min(shard_end, (pos // inner + 1) * inner)
                    offset, nbytes = (MISSING_CHUNK, MISSING_CHUNK) if fd < 0 else map(int, entries[k])
                    if (offset, nbytes) == (MISSING_CHUNK, MISSING_CHUNK):
                        dst[pos - lo:stop - lo].zero_()
                    elif nbytes != 4 * inner or offset + nbytes > data_bytes:
                        raise ValueError(f"shard {shard}'s index puts chunk {k} at bytes [{offset}, {offset + nbytes})"
                                         f" of {data_bytes} (chunks are {4 * inner} bytes)")
                    else:
                        _pread_into(fd, raw[4 * (pos - lo):4 * (stop - lo)], offset + 4 * (pos % inner))
                    pending.append(crc_worker.submit(crc.update, dst[pos - lo:stop - lo]))
                    pos = stop
            finally:
                if fd >= 0:
                    os.close(fd)
    finally:
        for f in pending:  # in order; all done before dst is used or dropped
            f.result()


def restore(engine: "Engine", path: str, manifest: dict[str, Any]) -> None:
    """Read the arrays of a step directory into the engine's store, verify their CRC32s, restore the steps."""
    try:
        _restore(engine, path, manifest)
    except (KeyError, TypeError, AttributeError, IndexError):
        raise InputError(f"{os.path.join(path, MANIFEST)} is corrupt (a field is missing or of the wrong type); "
                         "load the previous step directory instead") from None


def _restore(engine: "Engine", path: str, manifest: dict[str, Any]) -> None:
    if manifest["tensors"] != _tensor_table(engine):
        raise InputError(f"{path}: the checkpoint's parameter layout differs from this megatrain's; "
                         "load it with the megatrain version that wrote it")
    engine.synchronize()
    store = engine.store
    live = {kind: SpilledArena(store, kind) if kind in store.spilled else store._arena(kind).tensor
            for kind in ("master", "exp_avg", "exp_avg_sq")}
    with cf.ThreadPoolExecutor(1, thread_name_prefix="megatrain-checkpoint-crc") as crc_worker:
        for name, dst in live.items():
            _restore_array(path, manifest["arrays"][name], store, name, dst, crc_worker)
    block_steps = manifest["engine"]["block_steps"]
    if len(block_steps) != len(store.steps):
        raise InputError(f"{path}: the manifest has step counts for {len(block_steps)} blocks, the model has "
                         f"{len(store.steps)}; the checkpoint is corrupt: load the previous step directory instead")
    for b, value in enumerate(block_steps):
        store.steps[b].fill_(value)
        store.refresh_shadow(b)
    engine._restore_step_count(int(manifest["engine"]["step_count"]))
    engine.checkpoint_extra = manifest["extra"]
    engine.hf_config = manifest["engine"]["hf_config"]


def _restore_array(path: str, meta: dict[str, Any], store: Any, name: str, dst: "torch.Tensor | SpilledArena",
                   crc_worker: cf.Executor) -> None:
    """One array of the checkpoint into dst (a RAM arena, or a spilled kind block by block), CRC32s verified."""
    import tensorstore as ts

    full = os.path.join(path, meta["path"])
    crc = _Crc32s()
    try:
        layout = _direct_layout(full)
        if layout is not None:
            shape = (layout[0],)
            read = functools.partial(_read_direct, full, layout, crc_worker=crc_worker)
        else:  # another layout: tensorstore reads it (the same pieces, one more copy)
            src = ts.open(_spec(full), open=True, read=True).result()
            shape, read = tuple(src.shape), functools.partial(_read_into, src)
        if shape != (dst.numel(),):
            raise InputError(f"{full} has shape {shape}, this model needs ({dst.numel()},); "
                             "the checkpoint does not match its manifest")
        if isinstance(dst, SpilledArena):
            for b in range(len(store.numels)):  # one block at a time through RAM into its spill file
                lo, n = store.offsets[b], store.numels[b]
                block = torch.empty(n, dtype=torch.float32)
                read(lo, block, crc)  # CRC of the bytes read, checked below once every block is in
                store.write_block(name, b, block)
        else:
            read(0, dst, crc)
    except InputError:
        raise
    except Exception as err:  # tensorstore and _read_direct report I/O and format errors as ValueError and others
        raise InputError(f"cannot read {full} ({str(err).splitlines()[0][:200]}); the checkpoint is corrupt: "
                         "load the previous step directory instead") from None
    got = crc.digest()
    if got != meta["crc32"]:
        bad = next(i for i, (a, b) in enumerate(zip(got, meta["crc32"])) if a != b) if len(got) == len(
            meta["crc32"]) else 0
        lo = bad * CRC_CHUNK_BYTES
        raise InputError(f"{full}: checksum mismatch in bytes [{lo}, {lo + CRC_CHUNK_BYTES}); the checkpoint is "
                         "corrupt: load the previous step directory instead")
