"""``megatrain-plan``'s value types and parser: a size, a positive number, and a bad value refused in one
line on stderr with status 2 (no usage dump). Pure stdlib."""
from __future__ import annotations

import argparse
import re
from typing import Any, NoReturn

from megatrain.errors import MegatrainError

from .hardware import GiB

PROG = "megatrain-plan"


class CliError(MegatrainError):
    """A command-line value the planner cannot use. One line: what, and the fix."""


class Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)   # --spill must never be read as --spill-dir
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # one line on stderr, status 2, no usage dump
        # argparse quotes the user's words as given: control characters (a '\r' value) are escaped, never printed.
        line = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
        self.exit(2, f"{PROG}: error: {line} (see {PROG} --help)\n")


def parse_size(text: str, what: str) -> int:
    """'512', '512G', '512GiB', '1.5T', '80GB' -> bytes; a bare number is GiB."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise CliError(f"{what}={text!r} is not a size; write e.g. 512G, 1.5T or 80 (GiB)")
    scale = {"": GiB, "k": 1024, "m": 1024 ** 2, "g": GiB, "t": 1024 ** 4}[m.group(2)]
    return int(float(m.group(1)) * scale)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value
