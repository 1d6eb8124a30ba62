"""megatrain-export: a training run (or one of its checkpoints) as a Hugging Face model directory.

    megatrain-export RUN_OR_CHECKPOINT OUT [--dtype bf16|fp32]

OUT then loads with ``AutoModelForCausalLM.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)``:
the weights and config.json are written by ``Engine.save_pretrained`` from the checkpoint
(``Engine.load_checkpoint``), and the tokenizer and generation files (``COPIED_FILES``) are copied from
the directories the run recorded: its ``--model`` directory, then its ``--tokenizer``'s directory (which
wins where both have a file). OUT must not exist or be empty: the export is written into a new
directory beside it and renamed into place when complete, so a failed export leaves nothing behind
and an existing directory is never written into (tools/export_staging.py: a killed export's folders are
removed by the next export). OUT gets the mode the user's umask gives a new directory.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any

from megatrain.runtime.errors import MegatrainError, NonFiniteError

from . import io_failure

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
DTYPES = ("bf16", "fp32")
# Files of a Hugging Face model directory that describe its tokenizer and generation defaults.
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
                "chat_template.json", "generation_config.json")


class ExportError(MegatrainError):
    """A bad argument or input: one line saying how to fix it."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ExportError(f"{message} (see megatrain-export --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="megatrain-export", allow_abbrev=False,
                     description="Write a megatrain-train run (its latest checkpoint, or the checkpoint named) as a "
                                 "Hugging Face model directory: weights, config, tokenizer and generation config.",
                     epilog="Exit status: 0 written; 2 a bad argument or input (one line); 74 a disk that filled "
                            "up or failed (the file named); 130 interrupted. OUT is never partly written.")
    parser.add_argument("source", metavar="RUN_OR_CHECKPOINT",
                        help="a megatrain-train --out directory, its checkpoints/ directory, or one step-N in it")
    parser.add_argument("out", metavar="OUT", help="the directory to write; it must not exist or be empty")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="weight dtype of the export (bf16)")
    parser.add_argument("--allow-nonfinite", action="store_true",
                        help="write weights holding NaN or infinity (a diverged run) instead of refusing them")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        written = export(args.source, args.out, args.dtype, say=lambda line: print(f"megatrain-export: {line}",
                                                                                     file=sys.stderr),
                         allow_nonfinite=args.allow_nonfinite)
    except MegatrainError as e:
        return _error(str(e))
    except OSError as e:  # a path (status 2), or a disk that filled up or failed (io_failure.EXIT_IO)
        _error(io_failure.line(e))
        return io_failure.exit_status(e)
    except KeyboardInterrupt:  # the partial export (beside OUT) is removed on the way out
        print("megatrain-export: interrupted; OUT was not written", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"megatrain-export: wrote {args.out} ({', '.join(written)})", file=sys.stderr)
    return 0


def export(source: str, out: str, dtype: str = "bf16", say: Any = None, allow_nonfinite: bool = False) -> list[str]:
    """Write ``source``'s checkpoint to ``out`` (see the module docstring); the names of the files written. Weights
    holding NaN or infinity are refused (nothing written) unless ``allow_nonfinite``."""
    import torch

    from megatrain.runtime import Engine

    from megatrain.runtime.io import checkpoint_format

    from megatrain.runtime.io import training_checkpoint

    from . import export_staging, run_dir

    if dtype not in DTYPES:
        raise ExportError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    check_out(out)
    if not os.path.exists(source):
        raise ExportError(f"{source} does not exist; pass a megatrain-train --out directory or one of its "
                          f"checkpoints")
    inner = os.path.join(source, run_dir.CHECKPOINT_DIR)
    path = training_checkpoint.resolve(inner if os.path.isdir(inner) else source)
    manifest = checkpoint_format.read_manifest(path)
    train_config = dict((manifest.get("extra") or {}).get("train_config") or {})
    copies = _tokenizer_files(train_config)
    plan = training_checkpoint.engine_arguments(manifest)["plan"]
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    stale = export_staging.reclaim(parent)  # what killed exports left here
    if stale and say is not None:
        say(f"removed {len(stale)} folder(s) left in {parent} by exports that no longer run: {', '.join(stale)}")
    staging = export_staging.create(parent, export_staging.staging_prefix(out))
    spill = (export_staging.create(parent, export_staging.SPILL_PREFIX)
             if plan is not None and plan.spill != "none" else None)
    try:
        # The checkpoint's spill files (if its plan spills) go to a scratch directory of our own, removed after.
        engine = Engine.load_checkpoint(path, device="cpu", plan=plan.replace(spill_dir=spill) if spill else None)
        try:
            try:
                engine.save_pretrained(staging, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype],
                                       allow_nonfinite=allow_nonfinite)
            except NonFiniteError as e:
                raise ExportError(f"{path}: {e}; export an earlier checkpoint (a step-N in its checkpoints/), or "
                                  f"pass --allow-nonfinite to write it anyway") from None
        finally:
            engine.close()
        for name, src in copies.items():
            shutil.copyfile(src, os.path.join(staging, name))
        export_staging.finish(staging)
        written = sorted(os.listdir(staging))
        check_out(out)  # nothing appeared there meanwhile
        if os.path.isdir(out):
            os.rmdir(out)  # empty: checked just above
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if spill:
            shutil.rmtree(spill, ignore_errors=True)
    if say is not None:
        say(f"exported {path}")
        if "tokenizer.json" not in copies and "tokenizer.model" not in copies:
            say("no tokenizer files copied (the run used the byte tokenizer or recorded no model directory); "
                "AutoTokenizer will not load this directory")
    return written


def check_target(out: str, holds: dict[str, str], option: str) -> None:
    """``out`` may receive an export once a run ends: new or empty, and not a directory that will hold one of
    ``holds`` (option -> path: the run directory, its spill directory), which would no longer be empty then."""
    try:
        check_out(out)
    except ExportError as e:
        raise ExportError(f"{option}: {e}") from None
    target = os.path.realpath(out).rstrip(os.sep) + os.sep
    for name, path in holds.items():
        if path and (os.path.realpath(path) + os.sep).startswith(target):
            raise ExportError(f"{option}: {out} would hold --{name.replace('_', '-')} {path}, and an export goes only "
                              f"into a new or empty directory; name another")


def export_run(checkpoints: str, out: str, dtype: str) -> tuple[str, str | None]:
    """``export`` at the end of a training run: (where it went, None), or (what failed, the one line saying so)."""
    try:
        export(checkpoints, out, dtype)
    except (MegatrainError, OSError) as e:
        line = (f"export to {out} failed ({str(e).splitlines()[0]}); the run's checkpoints are in {checkpoints}: "
                f"megatrain-export {checkpoints} NEW_DIR")
        return f"failed: {line}", line
    return out, None


def check_out(out: str) -> None:
    """``out`` may receive an export: it does not exist, or is an empty directory. Writes nothing."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ExportError(f"{out} is a file; name a new or empty directory for the export")
    if os.path.isdir(out) and os.listdir(out):
        raise ExportError(f"{out} already holds {len(os.listdir(out))} file(s); name a new or empty directory "
                          f"(an existing directory is never written into)")


def _tokenizer_files(train_config: dict[str, Any]) -> dict[str, str]:
    """Name -> source path of the files to copy: the run's --model directory's (a Hub name's snapshot, when
    the cache holds it), then its --tokenizer's."""
    from . import hub_models

    directories = []
    model, tok = train_config.get("model") or "", train_config.get("tokenizer") or ""
    if model and hub_models.is_hub_name(model):
        model = hub_models.cached(model, train_config.get("revision") or "") or ""
    if model and os.path.isdir(model):
        directories.append(model)
    if tok and tok != "byte":
        directories.append(tok if os.path.isdir(tok) else os.path.dirname(tok))
    files: dict[str, str] = {}
    for directory in directories:
        for name in COPIED_FILES:
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                files[name] = path
    if tok and tok != "byte" and os.path.isfile(tok) and os.path.basename(tok) != "tokenizer.json":
        files["tokenizer.json"] = tok  # a tokenizer file named otherwise is still the run's tokenizer
    return files


def _error(message: str) -> int:
    print(f"megatrain-export: error: {message.splitlines()[0] if message else 'invalid input'}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
