"""Training checkpoints: writing a model state's checkpoint, committing it atomically (in the background),
finding the one to load, and restoring it. The bytes on disk are ``checkpoint_format``'s.

[Note: checkpoint commit protocol]
A checkpoint of optimizer step N is the directory ``<dir>/step-<N:08d>``. It is
written as ``step-<N>.tmp``: three zarr v3 arrays (tensorstore, sharded, raw
``bytes`` codec) each fsynced, then ``manifest.json`` (everything else, plus the
CRC32 of each array and the size of every file), fsynced; then ``<dir>/latest``
(one line, the step directory's name) is replaced atomically (write
``latest.tmp``, fsync, ``os.replace``, fsync the parent), and then the directory
is renamed to ``step-<N>`` and the parent fsynced: no complete step directory is
ever newer than the one ``latest`` names (in between, ``latest`` names one not
there yet and a reader takes the newest complete one). Finally all but the newest ``keep``
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
training waits for the whole write. The planner counts the snapshot and the
writer's staging (one zarr shard) when asked for non-blocking saves
(``Workload.nonblocking_saves``; tests/test_checkpoint_memory.py
measures the peak against it).

"""
from __future__ import annotations

import concurrent.futures as cf
import errno
import json
import os
import shutil
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple

import torch

from megatrain.plan.plan import Plan

from megatrain.runtime.io import checkpoint_directory, checkpoint_format
from megatrain.runtime.io.checkpoint_directory import resolve
from megatrain.runtime.io.checkpoint_format import ARRAYS, DTYPE_NAMES, MANIFEST, live_arrays, read_manifest
from megatrain.runtime.config import ModelConfig, OptimizerConfig
from megatrain.runtime.errors import CheckpointError, ConfigError, InputError, MegatrainError
from megatrain.runtime.paths import user_path

if TYPE_CHECKING:
    from megatrain.runtime.state.model_state import ModelState

__all__ = ["CheckpointHandle", "CheckpointWriter", "Restored", "engine_arguments", "engine_settings",
           "read_manifest", "resolve", "restore"]

# Writes the checkpoint's arrays into the step's ``*.tmp`` directory; returns the manifest's ``arrays`` entries.
WriteArrays = Callable[[str], dict[str, Any]]
# Reads one array (its name and manifest entry) into the state, checking its CRC32s on the given worker.
ReadArray = Callable[[str, dict[str, Any], cf.Executor], None]


class Restored(NamedTuple):
    """What a restored checkpoint hands the training loop."""

    step: int  # the optimizer step it continues from (every update up to it applied)
    extra: Any  # the caller's ``extra`` saved with it


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

    def start(self, write: Callable[[], None]) -> None:
        """Run ``write`` (the commit) in a background thread."""
        self._thread = threading.Thread(target=write, name="megatrain-checkpoint", daemon=False)
        self._thread.start()

    def fail(self, error: BaseException) -> None:
        """Record the write's error, raised by ``wait()`` or warned once."""
        self._error = error

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    @property
    def failed_and_reported(self) -> bool:
        return self._reported and self.done() and self._error is not None

    def wait(self) -> str:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.path

    def report_unwaited(self, then: str) -> None:
        """Wait; warn once about a failed write nobody waited for (see [Note: failed checkpoint writes])."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None and not self._reported:
            self._reported = True
            warnings.warn(f"{_one_line(self._error)}; {then}", RuntimeWarning, stacklevel=4)


class CheckpointWriter:
    """At most one checkpoint in flight per engine (the snapshot bound: 12 B/param of host RAM)."""

    def __init__(self) -> None:
        self.last: CheckpointHandle | None = None

    def wait(self) -> str | None:
        """The last save's committed directory; its error raised once (None afterwards, and with no save)."""
        last = self.last
        if last is None or last.failed_and_reported:
            return None
        return last.wait()

    def close(self) -> None:
        """A background write finishes (a failure nobody waited for is warned about) before the state goes."""
        if self.last is not None:
            self.last.report_unwaited("nothing was saved")

    def save(self, state: "ModelState", step: int, settings: dict[str, Any], directory: str | os.PathLike,
             extra: Mapping[str, Any] | None, keep: int, blocking: bool,
             write_arrays: WriteArrays | None = None) -> CheckpointHandle:
        """Save ``state`` at optimizer step ``step`` to ``directory/step-<N>``; ``settings``: ``engine_settings``'.
        ``write_arrays``: writes the arrays instead (a data-parallel run's ranks: sharded_checkpoint.py); blocking."""
        start = time.perf_counter()
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ConfigError(f"keep={keep!r} must be an integer >= 1 (complete checkpoints to keep)")
        extra = _check_extra(extra)
        directory = _make_directory(directory)
        if self.last is not None:  # the previous write first (one snapshot at a time); its failure reported once
            self.last.report_unwaited(f"saving step {step} now")
        state.settle()
        manifest = checkpoint_format.build_manifest(state, step, settings, extra)
        live = live_arrays(state.store)
        handle = CheckpointHandle(os.path.join(directory, f"step-{step:08d}"))
        self.last = handle
        # With spilled state there is no RAM to snapshot into: write it now, block by block, from the files.
        if blocking or state.store.spilled or write_arrays is not None:
            _commit(handle, directory, step, live, manifest, keep, write_arrays)
            handle.stall_s = time.perf_counter() - start
            handle.wait()
            return handle
        snapshot = {name: _whole_copy(t) for name, t in live.items()}  # the stall: memcpy of master, m and v
        handle.start(lambda: _commit(handle, directory, step, snapshot, manifest, keep))
        handle.stall_s = time.perf_counter() - start
        return handle


def _whole_copy(t: "torch.Tensor | checkpoint_format.SpilledArena") -> torch.Tensor:
    """A host copy of a whole array: an arena cloned, or (blocks resident on the device) its blocks gathered."""
    if not isinstance(t, checkpoint_format.SpilledArena):
        return t.clone()
    out = torch.empty(t.numel(), dtype=t.dtype)
    for lo, block in t.pieces():
        out[lo:lo + block.numel()].copy_(block)
    return out


def engine_settings(config: ModelConfig, optimizer: OptimizerConfig, plan: Plan | None, compute_dtype: torch.dtype,
                    seed: int) -> dict[str, Any]:
    """The Engine(...) arguments a manifest records (``engine_arguments`` reads them back). ``plan`` None: the
    default plan before its first step set its micro-batch (the resumed engine sets it at its own)."""
    opt = optimizer
    return {
        "model_config": config.to_dict(),
        "optimizer": {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay,
                      "max_grad_norm": opt.max_grad_norm, "no_decay": list(opt.no_decay),
                      "skip_nonfinite": opt.skip_nonfinite, "state_dtype": opt.state_dtype},
        "plan": None if plan is None else plan.to_dict(),
        "compute_dtype": DTYPE_NAMES[compute_dtype],
        "seed": seed,
    }


def _check_extra(extra: Mapping[str, Any] | None) -> Any:
    if extra is None:
        return {}
    try:
        return json.loads(json.dumps(extra, allow_nan=False))  # a deep copy the caller cannot mutate any more
    except (TypeError, ValueError) as e:
        raise InputError(f"extra is not JSON-serialisable ({e}); pass plain dicts, lists, str, int, "
                         "finite float") from None


def _commit(handle: CheckpointHandle, directory: str, step: int, arrays: Mapping[str, Any],
            manifest: dict[str, Any], keep: int, write_arrays: WriteArrays | None = None) -> None:
    """Write, fsync, manifest, rename, latest, prune (see [Note: checkpoint commit protocol])."""
    start = time.perf_counter()
    final = handle.path
    tmp = final + ".tmp"
    made_tmp = False
    try:
        checkpoint_directory.clear_leftovers(directory)
        os.makedirs(tmp)
        made_tmp = True
        manifest["arrays"] = {} if write_arrays is None else write_arrays(tmp)
        with cf.ThreadPoolExecutor(1, thread_name_prefix="megatrain-checkpoint-fsync") as fsyncs:
            flushed = []
            # one after another: each one's writeback overlaps the next's encoding
            for name, t in (arrays.items() if write_arrays is None else ()):
                manifest["arrays"][name] = checkpoint_format.write_named_array(tmp, name, t)
                flushed.append(fsyncs.submit(checkpoint_directory.fsync_tree, os.path.join(tmp, name)))
            for f in flushed:
                f.result()
        files = {}  # every file fsynced again (clean by now: cheap), every directory, the sizes
        for root, dirs, names in os.walk(tmp):
            for n in names:
                full = os.path.join(root, n)
                checkpoint_directory.fsync_file(full)
                files[os.path.relpath(full, tmp).replace(os.sep, "/")] = os.path.getsize(full)
            for d in dirs:
                checkpoint_directory.fsync_dir(os.path.join(root, d))
        manifest["files"] = dict(sorted(files.items()))
        checkpoint_directory.write_durably(os.path.join(tmp, MANIFEST),
                                           json.dumps(manifest, indent=1, allow_nan=False) + "\n")
        checkpoint_directory.fsync_dir(tmp)
        made_tmp = False  # complete from here on: never removed as a failed write
        checkpoint_directory.publish(directory, tmp, final)
    except BaseException as e:
        if made_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        handle.fail(_write_error(e, directory, final, arrays) if isinstance(e, Exception) else e)
        handle.write_s = time.perf_counter() - start
        return
    try:  # committed: an error from here on concerns only the older checkpoints beyond ``keep``
        checkpoint_directory.prune(directory, os.path.basename(final), keep)
    except BaseException as e:
        reason = (e.strerror or str(e)) if isinstance(e, OSError) else _one_line(e)
        handle.fail(e if not isinstance(e, Exception) else CheckpointError(
            f"checkpoint {final} is saved, but removing older ones beyond keep={keep} failed ({reason}); "
            "remove them by hand"))
    finally:
        handle.write_s = time.perf_counter() - start


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
        need = sum(t.numel() * t.dtype.itemsize for t in arrays.values())  # bf16 m and v: 2 bytes each
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


# ---------------------------------------------------------------------- reading
def engine_arguments(manifest: dict[str, Any]) -> dict[str, Any]:
    """Engine(...) keyword arguments recorded in a manifest."""
    e = manifest["engine"]
    try:
        opt = dict(e["optimizer"])
        opt["betas"], opt["no_decay"] = tuple(opt["betas"]), tuple(opt["no_decay"])
        return {"model_config": ModelConfig(**e["model_config"]), "optimizer": OptimizerConfig(**opt),
                "plan": None if e["plan"] is None else Plan.from_dict(e["plan"]), "seed": e["seed"],
                "compute_dtype": {v: k for k, v in DTYPE_NAMES.items()}[e["compute_dtype"]]}
    except (KeyError, TypeError) as err:
        raise InputError(f"the checkpoint manifest's engine section is invalid ({err}); "
                         "load it with the megatrain that wrote it") from None


def restore(state: "ModelState", path: str, manifest: dict[str, Any],
            read_array: ReadArray | None = None) -> Restored:
    """Read the arrays of a step directory into the model state, verify their CRC32s, restore the AdamW step
    counts and the Hugging Face config; what the training loop continues from. ``read_array``: reads each
    array instead (a data-parallel rank's shards: sharded_checkpoint.py)."""
    try:
        if manifest["tensors"] != state.tensor_table():
            raise InputError(f"{path}: the checkpoint's parameter layout differs from this megatrain's; "
                             "load it with the megatrain version that wrote it")
        state.settle()
        with cf.ThreadPoolExecutor(1, thread_name_prefix="megatrain-checkpoint-crc") as crc_worker:
            for name in ARRAYS:
                if read_array is None:
                    checkpoint_format.read_array(path, manifest["arrays"][name], state.store, name, crc_worker)
                else:
                    read_array(name, manifest["arrays"][name], crc_worker)
        block_steps = manifest["engine"]["block_steps"]
        if len(block_steps) != len(state.steps):
            raise InputError(f"{path}: the manifest has step counts for {len(block_steps)} blocks, the model has "
                             f"{len(state.steps)}; the checkpoint is corrupt: load the previous step directory "
                             "instead")
        state.set_steps(block_steps)
        for b in range(len(block_steps)):
            state.store.refresh_shadow(b)
        state.hf_config = manifest["engine"]["hf_config"]
        return Restored(int(manifest["engine"]["step_count"]), manifest["extra"])
    except (KeyError, TypeError, AttributeError, IndexError):
        raise InputError(f"{os.path.join(path, MANIFEST)} is corrupt (a field is missing or of the wrong type); "
                         "load the previous step directory instead") from None
