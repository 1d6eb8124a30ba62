"""``megatrain-plan``: profile this machine, size hardware for a model, and choose the plan the runtime runs.

    megatrain-plan                       what this machine can train (every preset model)
    megatrain-plan profile               measure this machine into hardware.json
    megatrain-plan plan --model M ...    the chosen plan, its memory table, time breakdown, bottleneck
    megatrain-plan size --model M ...    minimum GPU / host / NVMe, and step time on each GPU preset
    megatrain-plan ram --model M ...     how much host RAM to buy for a throughput target, and its cost

Each takes ``--json``. A bad name, file or budget prints one line on stderr and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from typing import Any, NoReturn, Sequence

from . import hardware as hwmod
from . import model_shapes, profiler, report, search
from .hardware import GiB, HardwareError, HardwareProfile
from .model_shapes import ModelShapeError
from .plan import PlanError
from .search import InfeasibleError, PlanChoice
from .workload import Workload, WorkloadError

PROG = "megatrain-plan"
# Assumed DDR5 RDIMM price when --price-per-gb is not given (USD per GB, 2025 street prices, rough).
DEFAULT_PRICE_PER_GB = 4.0
# RAM is bought in steps; round what a run needs up to a multiple of this.
RAM_STEP_BYTES = 32 * GiB
# Share of installed RAM a run can use (the OS and page cache keep the rest); as in hardware.preset.
USABLE_RAM_FRACTION = 0.94


class CliError(ValueError):
    """A command-line value the planner cannot use. One line: what, and the fix."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line on stderr, status 2, no usage dump
        self.exit(2, f"{PROG}: error: {message} (see {PROG} --help)\n")


def parse_size(text: str, what: str) -> int:
    """'512', '512G', '512GiB', '1.5T', '80GB' -> bytes; a bare number is GiB."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise CliError(f"{what}={text!r} is not a size; write e.g. 512G, 1.5T or 80 (GiB)")
    scale = {"": GiB, "k": 1024, "m": 1024 ** 2, "g": GiB, "t": 1024 ** 4}[m.group(2)]
    return int(float(m.group(1)) * scale)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


# ---- shared arguments -----------------------------------------------------------------------

def _hardware_args(p: argparse.ArgumentParser, default_help: str = "this machine") -> None:
    p.add_argument("--hardware", help=f"GPU preset ({', '.join(hwmod.GPU_PRESETS)}) or hardware.json "
                                      f"(default: {default_help})")
    p.add_argument("--host", help=f"host preset for a GPU preset ({', '.join(hwmod.HOST_PRESETS)})")
    p.add_argument("--ram", help="override host RAM, e.g. 512G or 1T")
    p.add_argument("--gpu-mem", help="override GPU memory, e.g. 80G")
    p.add_argument("--nvme", type=_positive_float, help="override NVMe read/write GB/s")


def _workload_args(p: argparse.ArgumentParser, need_batch: bool) -> None:
    p.add_argument("--model", required=True, help=f"preset ({', '.join(model_shapes.PRESETS)}) or config.json")
    p.add_argument("--seq", type=_positive_int, default=None if need_batch else 4096,
                   required=need_batch, help="tokens per sequence")
    if need_batch:
        g = p.add_mutually_exclusive_group(required=True)
        g.add_argument("--batch", type=_positive_int, help="sequences per optimizer step")
        g.add_argument("--tokens-per-step", type=_positive_int, help="tokens per optimizer step (sets --batch)")
    p.add_argument("--dtype", default="bf16", help="compute dtype: bf16, fp16 or fp32 (default bf16)")
    p.add_argument("--no-clip", action="store_true",
                   help="no gradient clipping: lets the optimizer overlap backward (eager mode)")
    p.add_argument("--spill", choices=("auto", "none", "optimizer", "all"), default="auto",
                   help="what may live in spill files on disk: auto (the plan decides), none, optimizer (AdamW m, v), "
                        "all (fp32 master, m, v, grads)")
    p.add_argument("--spill-dir", help="directory for spill files (default: the current directory)")


def _hardware(args: argparse.Namespace, default: str | None = None) -> HardwareProfile:
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


def _workload(args: argparse.Namespace, batch: int | None = None) -> Workload:
    if batch is None:
        batch = args.batch if args.batch else -(-args.tokens_per_step // args.seq)
    return Workload(args.seq, batch, args.dtype, clipping=not args.no_clip, spill=args.spill,
                    spill_dir=args.spill_dir)


def _emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data, indent=2, sort_keys=True) if args.json else text)


def _choice_json(c: PlanChoice) -> dict[str, Any]:
    assert c.cost is not None
    return {"gpu_bytes": c.memory.device_bytes, "host_ram_bytes": c.memory.host_bytes,
            "pinned_host_bytes": c.memory.pinned_host_bytes, "nvme_bytes": c.memory.nvme_bytes,
            "step_seconds": c.cost.step_seconds, "tokens_per_second": c.cost.tokens_per_second,
            "model_tflops": c.cost.model_tflops, "mfu": c.cost.mfu, "bottleneck": c.cost.bottleneck}


# ---- commands -------------------------------------------------------------------------------

def cmd_plan(args: argparse.Namespace) -> None:
    model = model_shapes.resolve(args.model)
    work = _workload(args)
    hw = _hardware(args)
    result = search.search(model, work, hw)
    best = result.require()
    assert best.cost is not None
    if args.out:
        best.plan.save(args.out)
    data = {"params": model.params, "model": model.summary(), **_choice_json(best),
            "plan": best.plan.to_dict(), "memory": best.memory.rows(), "time": best.cost.to_dict(),
            "workload": {"seq_len": work.seq_len, "batch": work.batch, "tokens": work.tokens,
                         "compute_dtype": work.compute_dtype, "clipping": work.clipping},
            "hardware": {"gpu_name": hw.gpu_name, "source": hw.source}, "plans_considered": result.considered}
    c = best.cost
    p = best.plan
    text = "\n".join([
        f"{model.name} ({model_shapes.params_label(model.params)} params), {work.batch} x {work.seq_len} tokens "
        f"per step, {work.compute_dtype}, clipping {'on' if work.clipping else 'off'}",
        f"hardware: {report.hardware_line(hw)}",
        f"  source: {hw.source}", "",
        f"plan: {p.micro_batch_size} sequences x {work.micro_batches(p.micro_batch_size)} micro-batches, "
        f"{p.num_slots} slots (prefetch {p.prefetch_depth}), checkpoints on {p.checkpoints}, "
        f"optimizer {p.optimizer_mode}, loss chunk {p.loss_chunk_tokens} tokens"
        + (f", saved to {args.out}" if args.out else ""), "",
        report.memory_table(best.memory), "",
        report.time_table(c), "",
        f"step {report.seconds(c.step_seconds)}, {report.rate(c.tokens_per_second)}, model {c.model_tflops:.0f} "
        f"TFLOP/s (6N per token), MFU {c.mfu:.1%}; bottleneck: {c.bottleneck}; "
        f"{report.seconds(1e9 / c.tokens_per_second)} per billion tokens",
    ])
    _emit(args, data, text)


def cmd_size(args: argparse.Namespace) -> None:
    model = model_shapes.resolve(args.model)
    work = _workload(args)
    probe = hwmod.preset("H100-SXM")
    least = search.minimum_memory(model, work, probe)
    per_hw: list[dict[str, Any]] = []
    rows = []
    for name in hwmod.GPU_PRESETS:
        hw = hwmod.preset(name, args.host).with_overrides(
            ram_bytes=parse_size(args.ram, "--ram") if args.ram else None)
        r = search.search(model, work, hw)
        entry: dict[str, Any] = {"hardware": name, "feasible": r.feasible, "reason": r.reason(),
                                 "host_ram_available_bytes": hw.host_budget_bytes}
        if r.best is not None:
            entry.update(_choice_json(r.best))
            c = r.best.cost
            assert c is not None
            rows.append((name, report.gib(hw.host_budget_bytes), report.seconds(c.step_seconds),
                         report.rate(c.tokens_per_second), f"{c.mfu:.0%}", c.bottleneck))
        else:
            rows.append((name, report.gib(hw.host_budget_bytes), "-", "-", "-", r.reason()))
        per_hw.append(entry)
    fastest = min((e for e in per_hw if e["feasible"]), key=lambda e: e["step_seconds"], default=None)
    data = {"params": model.params, "model": model.summary(),
            "gpu_bytes": least["gpu"].memory.device_bytes, "host_ram_bytes": least["host"].memory.host_bytes,
            "nvme_bytes": 0,
            "step_seconds": fastest["step_seconds"] if fastest else None,
            "tokens_per_second": fastest["tokens_per_second"] if fastest else None,
            "fastest_hardware": fastest["hardware"] if fastest else None, "hardware": per_hw}
    text = "\n".join([
        f"{model.name} ({model_shapes.params_label(model.params)} params), {work.batch} x {work.seq_len} tokens "
        f"per step, {work.compute_dtype}, clipping {'on' if work.clipping else 'off'}",
        f"minimum GPU memory {report.gib(data['gpu_bytes'])} (plan: {least['gpu'].plan.micro_batch_size} seq "
        f"per micro-batch, checkpoints on {least['gpu'].plan.checkpoints}); minimum host RAM "
        f"{report.gib(data['host_ram_bytes'])} (optimizer {least['host'].plan.optimizer_mode}); NVMe 0 "
        f"(spill: issue #6)", "",
        report.table(("GPU preset", "host RAM", "step", "throughput", "MFU", "bound by / why not"), rows,
                     (False, True, True, True, True, False)),
    ])
    _emit(args, data, text)


def cmd_ram(args: argparse.Namespace) -> None:
    model = model_shapes.resolve(args.model)
    hw = _hardware(args)
    # Host RAM is what we are sizing: plan as if it were unlimited, then read off what the plan needs.
    unlimited = hw.replace(host_ram_bytes=1 << 60, host_available_bytes=1 << 60, cgroup_limit_bytes=0)
    target = args.tokens_per_second
    best: PlanChoice | None = None
    fastest = (0.0, 0)
    batch = 1
    while batch <= args.max_batch:
        work = _workload(args, batch=batch)
        fit, _ = search.feasible_choices(model, work, unlimited)
        for c in fit:
            assert c.cost is not None
            fastest = max(fastest, (c.cost.tokens_per_second, batch))
        enough = [c for c in fit if c.cost is not None and c.cost.tokens_per_second >= target]
        if enough:
            best = min(enough, key=lambda c: c.memory.host_bytes)
            break
        batch *= 2
    if best is None:
        raise CliError(f"--tokens-per-second={target:g} is out of reach for {model.name} on {hw.gpu_name}: "
                       f"at most {fastest[0]:,.0f} tok/s (batch {fastest[1]} x {args.seq}); lower the target "
                       f"or pick faster --hardware")
    assert best.cost is not None
    need = best.memory.host_bytes
    buy = math.ceil(need / USABLE_RAM_FRACTION / RAM_STEP_BYTES) * RAM_STEP_BYTES
    price = args.price_per_gb if args.price_per_gb is not None else DEFAULT_PRICE_PER_GB
    cost = buy / 1e9 * price
    data = {"params": model.params, "model": model.summary(), "target_tokens_per_second": target,
            **_choice_json(best), "batch": best.cost.tokens // args.seq, "seq_len": args.seq,
            "ram_to_buy_bytes": buy, "price_per_gb": price, "price_assumed": args.price_per_gb is None,
            "ram_cost": cost, "nvme_to_buy_bytes": 0, "plan": best.plan.to_dict(),
            "hardware": {"gpu_name": hw.gpu_name, "source": hw.source},
            "host_ram_installed_bytes": hw.host_ram_bytes}
    enough_now = hw.host_budget_bytes >= need
    text = "\n".join([
        f"{model.name} at >= {target:,.0f} tok/s on {hw.gpu_name}: batch {data['batch']} x {args.seq}, "
        f"{report.rate(best.cost.tokens_per_second)} predicted (MFU {best.cost.mfu:.0%})",
        f"host RAM the run needs: {report.gib(need)} ({report.gib(best.memory.pinned_host_bytes)} pinned); "
        f"buy {report.gib(buy)} (usable {USABLE_RAM_FRACTION:.0%}, in {report.gib(RAM_STEP_BYTES)} steps)",
        f"cost: {buy / 1e9:,.0f} GB x ${price:.2f}/GB = ${cost:,.0f}"
        + (" (price assumed; pass --price-per-gb)" if args.price_per_gb is None else ""),
        f"NVMe: 0 (spill not implemented yet, issue #6); this hardware has {report.gib(hw.host_ram_bytes)} RAM: "
        + ("enough" if enough_now else "not enough"),
    ])
    _emit(args, data, text)


def cmd_profile(args: argparse.Namespace) -> None:
    if args.spill_dir and not os.path.isdir(args.spill_dir):
        raise CliError(f"--spill-dir={args.spill_dir!r} is not a directory; pass an existing folder on the NVMe")
    log = (lambda s: None) if args.json else (lambda s: print(f"measuring: {s}", file=sys.stderr))
    hw = profiler.measure(args.spill_dir, log=log)
    out = args.out or profiler.CACHE_PATH
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    hw.save(out)
    text = "\n".join([report.hardware_line(hw), f"matmul TFLOP/s: " + ", ".join(
        f"{k} {v:.2f}" for k, v in hw.matmul_tflops.items()),
        "AdamW by threads: " + ", ".join(f"{n}: {r / 1e9:.2f} Gparam/s" for n, r in hw.adam_by_threads),
        f"disk: read {hw.disk_read_gbps:.2f} / write {hw.disk_write_gbps:.2f} GB/s", f"source: {hw.source}",
        f"saved to {out}"])
    _emit(args, {**hw.to_dict(), "saved_to": out}, text)


def cmd_overview(args: argparse.Namespace) -> None:
    hw = _hardware(args)
    rows, entries = [], []
    for name, model in model_shapes.PRESETS.items():
        work = Workload(args.seq, args.batch, args.dtype, clipping=not args.no_clip)
        r = search.search(model, work, hw)
        ctx = search.longest_context(model, hw, 1, work.compute_dtype, work.clipping)
        e: dict[str, Any] = {"model": name, "params": model.params, "feasible": r.feasible, "reason": r.reason(),
                             "longest_context_batch1": ctx}
        if r.best is not None and r.best.cost is not None:
            e.update(_choice_json(r.best))
            c, m = r.best.cost, r.best.memory
            rows.append((name, model_shapes.params_label(model.params), "yes", report.rate(c.tokens_per_second),
                         f"{c.mfu:.0%}", report.gib(m.host_bytes), report.gib(m.device_bytes), "0", str(ctx)))
        else:
            rows.append((name, model_shapes.params_label(model.params), "no", "-", "-", "-", "-", "-",
                         str(ctx) if ctx else "-"))
        entries.append(e)
    ok = [e for e in entries if e["feasible"]]
    largest = max(ok, key=lambda e: e["params"], default=None)
    longest = max(entries, key=lambda e: e["longest_context_batch1"])
    data = {"hardware": {"gpu_name": hw.gpu_name, "source": hw.source}, "seq_len": args.seq,
            "batch": args.batch, "models": entries,
            "largest_model": largest["model"] if largest else None,
            "longest_context": {"model": longest["model"], "seq_len": longest["longest_context_batch1"]}}
    lines = [f"this machine: {report.hardware_line(hw)}", f"  source: {hw.source}", "",
             f"each preset model at {args.batch} x {args.seq} tokens per step ({args.dtype}):",
             report.table(("model", "params", "fits", "throughput", "MFU", "host RAM", "GPU mem", "NVMe",
                           "max seq (batch 1)"), rows, (False, True, False, True, True, True, True, True, True))]
    lines.append("")
    lines.append(f"largest model it can train: {largest['model'] if largest else 'none of the presets'}; "
                 f"longest context: {longest['longest_context_batch1']} tokens ({longest['model']}, batch 1)")
    for e in entries:
        if not e["feasible"]:
            lines.append(f"  {e['model']}: {e['reason']}")
    _emit(args, data, "\n".join(lines))


# ---- entry point ----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Profile this machine, size hardware for a model, and choose the plan "
                                       "megatrain runs. With no command: what this machine can train.")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--seq", type=_positive_int, default=4096, help="overview: tokens per sequence (4096)")
    p.add_argument("--batch", type=_positive_int, default=16, help="overview: sequences per step (16)")
    p.add_argument("--dtype", default="bf16", help="overview: compute dtype (bf16)")
    p.add_argument("--no-clip", action="store_true", help="overview: no gradient clipping")
    _hardware_args(p)
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="{profile,calibrate,plan,size,ram}")

    sp = sub.add_parser("profile", help="measure this machine into hardware.json")
    sp.add_argument("--out", help=f"where to write it (default {profiler.CACHE_PATH}, which other commands read)")
    sp.add_argument("--spill-dir", help="measure disk read/write GB/s in this folder")
    sp.add_argument("--json", action="store_true", help="print JSON for scripts")

    # Runs the runtime, which the planner never imports: main() hands it to its own process.
    sub.add_parser("calibrate", add_help=False, help="fit the cost and memory constants from real training steps "
                                                     "on this machine (--help for its options)")

    sp = sub.add_parser("plan", help="choose the plan for a model, sequence and batch")
    _workload_args(sp, need_batch=True)
    _hardware_args(sp)
    sp.add_argument("--out", help="write the plan JSON the runtime executes")
    sp.add_argument("--json", action="store_true", help="print JSON for scripts")

    sp = sub.add_parser("size", help="minimum memory, and step time on each GPU preset")
    _workload_args(sp, need_batch=True)
    sp.add_argument("--host", help=f"host preset for every GPU ({', '.join(hwmod.HOST_PRESETS)}); "
                                   "default: each GPU's usual host")
    sp.add_argument("--ram", help="override host RAM on every preset, e.g. 1T")
    sp.add_argument("--json", action="store_true", help="print JSON for scripts")

    sp = sub.add_parser("ram", help="how much host RAM to buy for a throughput target")
    _workload_args(sp, need_batch=False)
    sp.add_argument("--tokens-per-second", type=_positive_float, required=True, help="throughput target")
    sp.add_argument("--price-per-gb", type=_positive_float, help=f"USD per GB (default {DEFAULT_PRICE_PER_GB}, "
                                                                 "an assumption)")
    sp.add_argument("--max-batch", type=_positive_int, default=4096, help="largest batch to try (4096)")
    _hardware_args(sp)
    sp.add_argument("--json", action="store_true", help="print JSON for scripts")
    return p


COMMANDS = {"plan": cmd_plan, "size": cmd_size, "ram": cmd_ram, "profile": cmd_profile, None: cmd_overview}
USER_ERRORS = (CliError, ModelShapeError, HardwareError, WorkloadError, InfeasibleError, PlanError)


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
