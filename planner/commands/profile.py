"""``megatrain-plan profile``: measure this machine into hardware.json, which the other commands read; with
``--disk-only``, measure the spill disk again into the saved profile, keeping the rest (and its calibration)."""
from __future__ import annotations

import argparse
import os
import stat
import sys
import tempfile
from typing import Any

from . import cli_args, report
from ..profiling import disk_profile, profiler
from .cli_args import CliError
from ..profiling.hardware import HardwareError, HardwareProfile


def add_parser(sub: Any) -> None:
    sp = sub.add_parser("profile", help="measure this machine into hardware.json")
    sp.add_argument("--out", help=f"where to write it (default {profiler.CACHE_PATH}, which other commands read)")
    sp.add_argument("--spill-dir", help="measure disk read/write GB/s in this folder")
    sp.add_argument("--disk-only", action="store_true",
                    help="with --spill-dir: measure only the disk, into the saved profile (--out or the default), "
                         "keeping its other figures and calibration (a disk's speed can move between runs)")
    sp.add_argument("--compiled-layers", action="store_true",
                    help="on a GPU, also time a decoder layer through torch.compile against eager (a minute or two "
                         "more, compiling): plans then compile their layers where that measured faster")
    cli_args.json_arg(sp)


def run(args: argparse.Namespace) -> None:
    if args.spill_dir and not os.path.isdir(args.spill_dir):
        raise CliError(f"--spill-dir={args.spill_dir!r} is not a directory; pass an existing folder on the NVMe")
    out = args.out or profiler.CACHE_PATH
    saved = _saved_profile(out, args.spill_dir) if args.disk_only else None
    check_writable(out)
    log = (lambda s: None) if args.json else (lambda s: print(f"measuring: {s}", file=sys.stderr))
    if saved is not None:
        hw = disk_profile.with_disk_measured(saved, disk_profile.measure_disk(args.spill_dir, profiler.cpu_matmul(),
                                                                              log), args.spill_dir)
    else:
        hw = profiler.measure(args.spill_dir, log=log, compiled_layers=args.compiled_layers)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    _save(hw, out)
    report.emit(args.json, {**hw.to_dict(), "saved_to": out}, report.profile_text(hw, out))


def check_writable(path: str) -> None:
    """Refuse, before measuring, a destination that cannot be written: make its folder and write a scratch
    file there (removed at once); an existing file is left as it is."""
    if os.path.isdir(path):
        raise CliError(f"--out={path!r} is a directory; name a file, e.g. {os.path.join(path, 'hardware.json')}")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        fd, scratch = tempfile.mkstemp(prefix=".megatrain-write-check-", dir=folder)
        os.close(fd)
        os.unlink(scratch)
    except OSError as e:
        raise CliError(f"--out={path!r} cannot be written ({e.strerror} in {folder}); pass --out in a folder you "
                       f"can write") from None
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise CliError(f"--out={path!r} exists and is not writable; pass another --out")


def _saved_profile(path: str, spill_dir: str | None) -> HardwareProfile:
    """The profile ``--disk-only`` updates, read before anything is measured; one line naming the fix if there
    is no disk to measure or no readable profile there."""
    if not spill_dir:
        raise CliError("--disk-only measures the spill disk again: pass --spill-dir DIR, the folder the spill "
                       "files go in")
    if not os.path.exists(path):
        raise CliError(f"--disk-only updates a saved profile and there is none at {path}; run megatrain-plan "
                       f"profile --spill-dir {spill_dir}" + (f" --out {path}" if path != profiler.CACHE_PATH else "")
                       + " first")
    try:
        return HardwareProfile.load(path)
    except (HardwareError, OSError) as e:
        raise CliError(f"--disk-only cannot read the profile at {path} ({e}); measure it whole with megatrain-plan "
                       f"profile --spill-dir {spill_dir}") from None


def _save(hw: HardwareProfile, path: str) -> None:
    """Written whole or not at all: beside ``path`` first (with the mode of the file it replaces), then renamed
    over it, so a profile there, calibrated perhaps, is never left half-written."""
    scratch = f"{path}.{os.getpid()}.tmp"
    try:
        hw.save(scratch)
        if os.path.exists(path):
            os.chmod(scratch, stat.S_IMODE(os.stat(path).st_mode))
        os.replace(scratch, path)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
