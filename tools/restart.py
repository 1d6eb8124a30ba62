"""``--resume-or-start``: the same command starts a run and continues it after a restart.

What torchrun's ``--max-restarts`` and a cluster scheduler's requeue need: they run the command they were given
again, and it must pick the run up where its last complete checkpoint left it. With ``--resume-or-start``:

- ``--out`` holds a complete checkpoint: the run resumes from the latest one, as ``--resume OUT`` would (a later
  step directory still being written when the run died is not complete and is not read);
- ``--out`` holds the files of a run that stopped before its first checkpoint (its ``RUN_RECORD``, written when
  the run took the directory): the run starts over, replacing those files (metrics rows, the lock);
- ``--out`` is new or empty: the run starts;
- ``--out``'s latest checkpoint is at the run's last step (the run finished, then was requeued): ``RunFinished``,
  which ``megatrain-train`` reports as one line and exit status 0; nothing is written.

A directory that holds another run (an option that defines the model, the data or the optimizer state differs
from the recorded run's) or files no run recorded is refused, as for any new run: nothing is deleted or mixed.

Without ``--resume-or-start``, a plain re-run of a run killed before its first step finished (``killed_at_start``:
its record, an empty metrics file and its lock are all ``--out`` holds) replaces those files, as ``--overwrite``
would; any other contents keep ``--out`` refused.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

from megatrain.runtime import MegatrainError
from megatrain.runtime.io import training_checkpoint

from . import resume, run_dir, train_config
from .train_config import TrainConfig, TrainConfigError

RUN_RECORD = "run.json"  # the options of the run that took the directory (absolute paths)


class RunFinished(Exception):
    """The run in ``--out`` already trained all its steps: nothing to do (not an error: exit status 0)."""


def resolve(values: Mapping[str, Any], config: TrainConfig) -> tuple[dict[str, Any], TrainConfig]:
    """The options to run with: ``--resume OUT`` when OUT holds a checkpoint of this run, ``--overwrite`` when it
    holds only the files of this run's start, the options unchanged otherwise."""
    if not config.resume_or_start:
        return dict(values), config
    values = {k: v for k, v in values.items() if k != "resume_or_start"}
    out = config.out
    checkpoint = latest_checkpoint(out)
    saved = _checkpoint_config(checkpoint) if checkpoint is not None else _recorded(out)
    if saved is None:
        return values, train_config.build(values)  # nothing of a run there: start (refused later if not empty)
    refuse_another_run(out, saved, config)
    if checkpoint is None:
        return {**values, "overwrite": True}, train_config.build(values)
    values["resume"] = out
    config = train_config.build(values)
    resumed = resume.read(config, values)
    if resumed.step >= resumed.config.total_steps:
        raise RunFinished(f"{out} is already done: its checkpoint is at step {resumed.step} of "
                          f"{resumed.config.total_steps}; nothing to train (raise --steps to train further)")
    return values, config


def latest_checkpoint(out: str) -> str | None:
    """The step directory a resume of ``out`` would read; None when it has no complete checkpoint."""
    root = os.path.join(out, run_dir.CHECKPOINT_DIR)
    if not os.path.isdir(root):
        return None
    try:
        return training_checkpoint.resolve(root)
    except MegatrainError:
        return None


def record(out: str, config: TrainConfig) -> None:
    """Write ``RUN_RECORD`` in the run directory (rank 0, when it takes the directory)."""
    path = os.path.join(out, RUN_RECORD)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(train_config.absolute_paths(config), f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def killed_at_start(out: str, config: TrainConfig) -> bool:
    """``out`` holds only what a start of this same run wrote before it was killed at its first step: its
    ``RUN_RECORD`` (these options), an empty metrics file, its lock. A plain re-run replaces them; anything else
    in ``out`` (a metrics row, a checkpoint, another run's record, a file of the user's) keeps it refused."""
    if config.resume or config.resume_or_start:
        return False
    entries = set(run_dir.existing_entries(out)) - {run_dir.LOCK_FILE}
    if RUN_RECORD not in entries or not entries <= {RUN_RECORD, run_dir.METRICS_FILE}:
        return False
    metrics_file = os.path.join(out, run_dir.METRICS_FILE)
    if run_dir.METRICS_FILE in entries and (os.path.islink(metrics_file) or not os.path.isfile(metrics_file)
                                            or os.path.getsize(metrics_file) > 0):
        return False
    saved = _recorded(out)
    if saved is None:
        return False
    try:
        refuse_another_run(out, saved, config)
    except TrainConfigError:
        return False
    return True


def drop_lone_record(out: str) -> None:
    """Delete ``RUN_RECORD`` when it is all the run wrote (it stopped before its first step): nothing to restart."""
    if run_dir.existing_entries(out) == [RUN_RECORD]:
        os.remove(os.path.join(out, RUN_RECORD))


def refuse_another_run(out: str, saved: Mapping[str, Any], config: TrainConfig) -> None:
    """One line when the run recorded in ``out`` is not the one these options describe."""
    now = train_config.absolute_paths(config)
    for key in train_config.FIXED_ON_RESUME:
        old = saved.get(key, getattr(TrainConfig, key, None))
        if _comparable(key, old) != _comparable(key, now[key]):
            raise TrainConfigError(f"resume_or_start: {out} holds another run ({key} {old!r}, not {now[key]!r}); "
                                   f"pass that run's options, or another --out")


def _comparable(key: str, value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_comparable(key, v) for v in value]
    if key in train_config.PATH_KEYS and isinstance(value, str) and value and os.path.exists(value):
        return os.path.realpath(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def _checkpoint_config(path: str) -> dict[str, Any] | None:
    extra = training_checkpoint.read_manifest(path).get("extra") or {}
    saved = extra.get("train_config")
    return dict(saved) if isinstance(saved, dict) else None


def _recorded(out: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(out, RUN_RECORD), encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None
