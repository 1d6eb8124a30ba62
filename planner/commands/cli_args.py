"""``megatrain-plan``'s arguments: the value types (a size, a positive number), the parser (a bad value refused
in one line on stderr with status 2, no usage dump), the option groups several commands share (hardware,
workload) and what they resolve to. Pure stdlib."""
from __future__ import annotations

import argparse
import re
from typing import Any, NoReturn

from megatrain.errors import MegatrainError

from megatrain.planner.profiling import hardware as hwmod
from megatrain.planner.shapes import model_shapes
from megatrain.planner.profiling import profiler
from megatrain.planner.profiling.hardware import GiB, HardwareProfile
from megatrain.planner.shapes.workload import Workload

PROG = "megatrain-plan"
# size and ram plan for hardware you may not have: their spill plans name this stand-in for its NVMe
# folder (not a directory; megatrain-train needs a real one, --spill-dir).
NVME_DIR = "<nvme>"


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


class RenamedOption(argparse.Action):
    """An old spelling of an option: refused in one line naming the option to use (``new``)."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} is spelled {self.new}: pass {self.new} {values if values else 'N'}")


def seq_len_arg(p: argparse.ArgumentParser, **kwargs: Any) -> None:
    """--seq-len (the name megatrain-train uses too); the old --seq is refused naming it."""
    p.add_argument("--seq-len", type=positive_int, **kwargs)
    p.add_argument("--seq", action=RenamedOption, new="--seq-len")


def hardware_args(p: argparse.ArgumentParser, default_help: str = "this machine") -> None:
    p.add_argument("--hardware", help=f"GPU preset ({', '.join(hwmod.GPU_PRESETS)}) or hardware.json "
                                      f"(default: {default_help})")
    p.add_argument("--host", help=f"host preset for a GPU preset ({', '.join(hwmod.HOST_PRESETS)})")
    p.add_argument("--ram", help="override host RAM, e.g. 512G or 1T")
    p.add_argument("--gpu-mem", help="override GPU memory, e.g. 80G")
    p.add_argument("--nvme", type=positive_float, help="override NVMe read/write GB/s")


def workload_args(p: argparse.ArgumentParser, need_batch: bool, sizing_only: bool = False,
                  default_batch: int | None = None) -> None:
    """The step's options. ``need_batch``: --batch (or --tokens-per-step) is asked for, and --seq-len with it,
    unless ``default_batch`` gives both a default (that batch of 4096-token sequences)."""
    p.add_argument("--model", required=True, help=f"preset ({', '.join(model_shapes.PRESETS)}) or config.json")
    required = need_batch and default_batch is None
    seq_len_arg(p, default=None if required else 4096, required=required,
                help="tokens per sequence" + ("" if required else " (default 4096)"))
    if need_batch:
        g = p.add_mutually_exclusive_group(required=required)
        g.add_argument("--batch", type=positive_int, default=default_batch, help="sequences per optimizer step" + (
            "" if required else f" (default {default_batch})"))
        g.add_argument("--tokens-per-step", type=positive_int, help="tokens per optimizer step (sets --batch)")
    p.add_argument("--dtype", default="auto", help="compute dtype: bf16, fp16, fp32, or auto (default: bf16 unless "
                                                   "the hardware multiplies fp32 faster)")
    p.add_argument("--no-clip", action="store_true",
                   help="no gradient clipping: lets the optimizer overlap backward (eager mode)")
    p.add_argument("--spill", choices=("auto", "none", "optimizer", "all"), default="auto",
                   help="what may live in spill files on disk: auto (the plan decides), none, optimizer (AdamW m, v), "
                        "all (fp32 master, m, v, grads)")
    p.add_argument("--optimizer-state", choices=("fp32", "bf16"), default="fp32",
                   help="AdamW m and v, in host RAM or spill files: fp32 (12 bytes/param of state with the master; "
                        "default) or bf16 (8 bytes/param, stochastic rounding)")
    p.add_argument("--save-every", type=positive_int, metavar="N",
                   help="the run saves a checkpoint every N steps (megatrain-train's option): RAM for the save's "
                        "snapshot of the master and AdamW state is counted")
    if sizing_only:
        p.add_argument("--spill-dir", help=f"the spill folder the plans name (default {NVME_DIR}: the NVMe of "
                                           "the hardware being sized)")
    else:
        p.add_argument("--spill-dir", help="directory for spill files, on a fast local disk; without it nothing "
                                           "spills")


def json_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON for scripts")


def resolve_hardware(args: argparse.Namespace, default: str | None = None) -> HardwareProfile:
    """--hardware (a preset or a file; default: this machine) with --host, --ram, --gpu-mem, --nvme applied."""
    name = args.hardware or default
    if name is None:
        if args.host:
            raise CliError("--host needs --hardware with a GPU preset; e.g. --hardware H100-SXM --host server-1t")
        hw = profiler.this_machine()
    else:
        hw = hwmod.resolve(name, args.host)
    return hw.with_overrides(
        ram_bytes=parse_size(args.ram, "--ram") if args.ram else None,
        gpu_mem_bytes=parse_size(args.gpu_mem, "--gpu-mem") if args.gpu_mem else None,
        nvme_gbps=args.nvme)


def is_preset(args: argparse.Namespace) -> bool:
    """--hardware names a GPU preset: hardware described, not this machine."""
    return bool(args.hardware) and args.hardware.lower() in {k.lower() for k in hwmod.GPU_PRESETS}


def compute_dtype(args: argparse.Namespace, hw: HardwareProfile) -> str:
    """--dtype, or for auto the planner's choice for this hardware."""
    return hwmod.preferred_compute_dtype(hw) if args.dtype == "auto" else args.dtype


def workload(args: argparse.Namespace, dtype: str, batch: int | None = None, spill_dir: str | None = None,
             free: int | None = None) -> Workload:
    """The step the workload options describe (--batch, or --tokens-per-step rounded up to whole sequences)."""
    if batch is None:
        batch = -(-args.tokens_per_step // args.seq_len) if args.tokens_per_step else args.batch
    return Workload(args.seq_len, batch, dtype, clipping=not args.no_clip, spill=args.spill, spill_dir=spill_dir,
                    spill_free_bytes=free, optimizer_state=args.optimizer_state,
                    nonblocking_saves=bool(args.save_every))
