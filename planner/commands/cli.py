"""``megatrain-plan``: profile this machine, size hardware for a model, and choose the plan the runtime runs.

    megatrain-plan                       what this machine can train (every preset model)
    megatrain-plan profile               measure this machine into hardware.json
    megatrain-plan plan --model M ...    the chosen plan, its memory table, time breakdown, bottleneck
    megatrain-plan size --model M ...    minimum GPU / host / NVMe, and step time on each GPU preset (or --hardware one)
    megatrain-plan ram --model M ...     batch and throughput per RAM size, with and without an NVMe; the least
                                         RAM reaching a throughput target, and its cost

Each takes ``--json``. A bad name, file or budget prints one line on stderr and exits with status 2. Each
command is a module of ``planner/commands/``; what it prints, ``planner/report_*.py``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Sequence

from megatrain.errors import MegatrainError

from megatrain.planner.commands.cli_args import PROG, Parser
from megatrain.planner.commands import overview, plan, profile, ram, size

COMMANDS = {"plan": plan.run, "size": size.run, "ram": ram.run, "profile": profile.run, None: overview.run}
USER_ERRORS = (MegatrainError,)  # every error a user can fix: PlanError, HardwareError, ... derive from it


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description="Profile this machine, size hardware for a model, and choose the plan "
                                      "megatrain runs. With no command: what this machine can train.")
    overview.add_arguments(p)
    sub = p.add_subparsers(dest="command", parser_class=Parser, metavar="{profile,calibrate,plan,size,ram}")
    profile.add_parser(sub)
    # Runs the runtime, which the planner never imports: main() hands it to its own process.
    sub.add_parser("calibrate", add_help=False, help="fit the cost and memory constants from real training steps "
                                                     "on this machine (--help for its options)")
    plan.add_parser(sub)
    size.add_parser(sub)
    ram.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:  # tools/calibrate.py drives the runtime; the planner only reads its result
        return subprocess.call([sys.executable, "-m", "megatrain.tools.calibrate", *argv[1:]])
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
    except USER_ERRORS as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into head & co: not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
