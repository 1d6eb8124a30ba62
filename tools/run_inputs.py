"""What a run reads is never inside what ``--overwrite`` deletes.

``--overwrite`` deletes the earlier run's own files in ``--out`` (``run_dir.RUN_FILES``: ``checkpoints/``,
``metrics.jsonl``, ``summary.json``, ...). An input that lies in one of them (``--data R/checkpoints/x.txt``,
``--model R/checkpoints/m``, ``--config R/run.json``...) would be deleted with the run, or, for a directory input,
one of its parts would be. ``refuse_inputs_in`` checks every input, both as given and with its symlinks resolved,
against every such entry that exists, before anything is deleted, and refuses the first overlap in one line.

A run file that is a symlink is removed as a link (its target stays), so only the link's own path counts.
"""
from __future__ import annotations

import os
from typing import Iterable

from . import run_dir
from .train_config import TrainConfig, TrainConfigError

# The options whose values are paths the run reads, as the command line spells them.
INPUT_FLAGS = (("data", "--data"), ("eval_data", "--eval-data"), ("model", "--model"), ("tokenizer", "--tokenizer"),
               ("plan", "--plan"))


def inputs(config: TrainConfig, config_file: str | None, resumed: str | None) -> list[tuple[str, str]]:
    """Every existing path the run reads: (the option, the path)."""
    found: list[tuple[str, str]] = []
    for key, flag in INPUT_FLAGS:
        value = getattr(config, key)
        for path in (value if isinstance(value, tuple) else (value,)):
            if path and os.path.exists(path):  # "demo", "byte", a Hub name: not a path here
                found.append((flag, path))
    if config_file:
        found.append(("--config", config_file))
    if resumed:
        found.append(("--resume", resumed))
    return found


def deleted_entries(out: str) -> list[str]:
    """What ``--overwrite`` would delete in ``out`` (``run_dir.remove_run_files``), as absolute paths: each
    existing run file, under ``out`` as given and resolved (a run file that is a symlink: the link alone)."""
    return [os.path.join(base, name) for base in dict.fromkeys((os.path.abspath(out), os.path.realpath(out)))
            for name in run_dir.RUN_FILES if os.path.lexists(os.path.join(base, name))]


def refuse_inputs_in(out: str, named: Iterable[tuple[str, str]]) -> None:
    """One line for the first input that lies in (or holds) something ``--overwrite`` would delete in ``out``."""
    entries = deleted_entries(out)
    if not entries:
        return
    for flag, path in named:
        for seen in {os.path.abspath(path), os.path.realpath(path)}:
            for entry in entries:
                if _overlap(seen, entry):
                    raise TrainConfigError(
                        f"overwrite: {flag} {path} is inside {entry}, which --overwrite would delete; move it out of "
                        f"{out} or choose another --out" if _within(seen, entry) else
                        f"overwrite: {flag} {path} holds {entry}, which --overwrite would delete; choose another "
                        f"--out")


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def _overlap(path: str, entry: str) -> bool:
    """``path`` is ``entry`` or inside it, or ``entry`` is inside the input directory ``path``."""
    return _within(path, entry) or (os.path.isdir(path) and _within(entry, path))
