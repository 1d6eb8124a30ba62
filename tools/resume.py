"""``megatrain-train --resume``: the checkpoint a run continues from, read (manifest only) before anything is
written, and the run's settings: the resumed run's, with the options given now on top (those it may change)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from megatrain.plan.plan import Plan
from megatrain.runtime import ModelConfig
from megatrain.runtime.io import training_checkpoint

from . import run_dir, train_config
from .train_config import TrainConfig, TrainConfigError


@dataclass
class Resumed:
    """The checkpoint a run resumes and where the run goes on from it."""

    path: str                 # the step directory
    extra: dict[str, Any]     # what megatrain-train saved with it
    model: ModelConfig
    plan: Plan
    run: str | None           # the run directory it belongs to (None: a checkpoint outside a run directory)
    config: TrainConfig       # the resumed run's settings, the options given now on top
    out: str                  # where the resumed run writes
    changes: list[str]        # options the resume changes, "name old -> new"
    step: int                 # the step, rows and tokens the run had done
    rows_done: int
    tokens_done: int
    data: dict[str, Any] | None   # the data position the checkpoint kept


def read(config: TrainConfig, values: Mapping[str, Any]) -> Resumed:
    """The checkpoint ``config.resume`` names (a run directory or one of its checkpoints); ``values`` are the
    options given explicitly."""
    path = training_checkpoint.resolve(checkpoint_root(config.resume))
    manifest = training_checkpoint.read_manifest(path)
    extra = dict(manifest.get("extra") or {})
    if "train_config" not in extra:
        raise TrainConfigError(f"resume: {path} was not written by megatrain-train (no training state); "
                               f"load it with Engine.load_checkpoint in your own loop")
    args = training_checkpoint.engine_arguments(manifest)
    run = run_dir.run_of_checkpoint(path)
    given = {k: v for k, v in values.items() if k != "overwrite"}
    if "out" in given:
        out = given["out"]
    elif run is not None:
        out = run
    else:
        raise TrainConfigError(f"resume: {path} is not inside a run directory (RUN/checkpoints/step-N); pass "
                               f"--out to say where the resumed run writes")
    saved = {k: v for k, v in extra["train_config"].items() if k not in ("out", "resume")}
    saved.setdefault("packing", "concat")  # a run from before --packing packed its rows end to end
    if "data" not in extra:  # a run from before the data order was kept trained in corpus order
        saved.setdefault("shuffle", False)
    changes = train_config.resume_changes(saved, given)
    merged = dict(saved)
    merged.update(given)
    merged.update(out=out, resume=config.resume)
    return Resumed(path, extra, args["model_config"], args["plan"], run, train_config.build(merged), out, changes,
                   int(extra["step"]), int(extra["rows_done"]), int(extra["tokens_done"]), extra.get("data"))


def refuse_branching(out: str, step: int) -> None:
    """Resuming an older checkpoint (at ``step``) of a run that went further would make two histories in one
    directory."""
    root = os.path.join(out, run_dir.CHECKPOINT_DIR)
    later = sorted(int(m.group(1)) for name in run_dir.existing_entries(root)
                   if (m := run_dir.STEP_DIR.fullmatch(name)) and int(m.group(1)) > step)
    if later:
        raise TrainConfigError(f"resume: {out} went on to step {later[-1]} after step {step}; "
                               f"continue from step {step} in a new run directory with --out NEW, "
                               f"or resume the latest with --resume {out}")


def checkpoint_root(path: str) -> str:
    """An earlier run's --out holds its checkpoints in a subdirectory; accept either."""
    inner = os.path.join(path, run_dir.CHECKPOINT_DIR)
    return inner if os.path.isdir(inner) else path
