"""``megatrain-plan profile``: measure this machine into hardware.json, which the other commands read."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

from .. import cli_args, profiler, report
from ..cli_args import CliError


def add_parser(sub: Any) -> None:
    sp = sub.add_parser("profile", help="measure this machine into hardware.json")
    sp.add_argument("--out", help=f"where to write it (default {profiler.CACHE_PATH}, which other commands read)")
    sp.add_argument("--spill-dir", help="measure disk read/write GB/s in this folder")
    cli_args.json_arg(sp)


def run(args: argparse.Namespace) -> None:
    if args.spill_dir and not os.path.isdir(args.spill_dir):
        raise CliError(f"--spill-dir={args.spill_dir!r} is not a directory; pass an existing folder on the NVMe")
    out = args.out or profiler.CACHE_PATH
    check_writable(out)
    log = (lambda s: None) if args.json else (lambda s: print(f"measuring: {s}", file=sys.stderr))
    hw = profiler.measure(args.spill_dir, log=log)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    hw.save(out)
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
