"""Which runs, in what order, within a time budget; the report rewritten after every run.

A comparison is a list of cases (model shape, sequence, batch), each run by every system.
``--sweep`` runs, in this order, until the time budget is spent:

1. sizes (default 1b, 3b) x sequence lengths (default 2048, 8192), every system, at a fixed
   number of tokens per step (``--sweep-tokens``; batch = tokens / seq, micro-batch =
   ``--sweep-micro-tokens`` / seq);
2. growth: more layers of the largest size's shape (``--grow-layers`` at a time), one level
   at a time for every system still running, until each fails (out of memory, or anything
   else) or ``--max-layers``.

[Note: budget] A run is started only with at least ``MIN_RUN_SECONDS`` left, and stopped
when the budget ends; what was not run is recorded as ``not run: the time budget ...`` and
``--resume`` runs those (and what is missing) again, keeping the rest; with
``--retry-failed`` also the runs that failed (not those out of memory). A row recorded as not run
for another reason (DeepSpeed not installed, no CUDA) is no result either: ``--resume`` decides it
again, so a run whose reason is gone (DeepSpeed installed since) runs, and one whose reason holds is
recorded as not run once more. Every row carries the header of the run that measured it (date,
command, machine, matmul peak: ``report.run_header``); rows kept from a report written before rows
carried one are stamped with that report's header.

[Note: micro-batch sweep] DeepSpeed ZeRO-3 gathers every parameter once per micro-batch, so its
best micro-batch is the largest that fits: it runs at each of ``DEEPSPEED_MICRO_BATCHES`` that
divides the batch (the peers' ``--micro-batch`` where none does); the report marks the fastest,
every run is kept.
"""
from __future__ import annotations

import datetime
import importlib.util
import os
import sys
import tempfile
import time
from typing import Any

from . import launcher, report
from .run_megatrain import import_megatrain
from .spec import DEEPSPEED_SYSTEMS, MODELS, RunSpec, model_config, model_label

MIN_RUN_SECONDS = 45
DEEPSPEED_MICRO_BATCHES = (4, 8, 16)  # [Note: micro-batch sweep]
NOT_RUN = "not run"  # every status of a run that did not start ([Note: budget])
BUDGET_NOT_RUN = f"{NOT_RUN}: the time budget"


def echo(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Comparison:
    def __init__(self, machine: dict[str, Any], out_dir: str, logs_dir: str | None, settings: dict[str, Any],
                 budget_seconds: float | None, run_timeout: float, resume: bool, retry_failed: bool = False) -> None:
        self.machine = machine
        self.device = machine["device"]
        self.peak = machine["matmul_peak"]["tflops"]
        self.date = datetime.date.today().isoformat()
        self.stem = os.path.join(out_dir, f"{self.date}_{report.device_label(machine)}_peers")
        self.logs = logs_dir or tempfile.mkdtemp(prefix="peers-logs-")
        os.makedirs(self.logs, exist_ok=True)
        self.settings = settings
        self.deadline = None if budget_seconds is None else time.monotonic() + budget_seconds
        self.run_timeout = run_timeout
        self.rows: list[dict[str, Any]] = []
        self.done: set[tuple] = set()
        if resume:
            old = report.load(self.stem)
            if old is not None:
                again = (NOT_RUN, "failed") if retry_failed else (NOT_RUN,)
                keep = [r for r in old["runs"] if not r["status"].startswith(again)]
                stamp = report.run_header(old["machine"], old["date"], old.get("settings", {}).get("command"))
                for r in keep:
                    r.setdefault("run_header", stamp)
                self.rows = keep
                self.done = {report.run_key(r) for r in keep}
                echo(f"resuming {self.stem}.json: {len(keep)} runs kept")
        import_megatrain()
        from megatrain.planner.shapes import model_shapes

        self._shape = model_shapes.from_config

    def spec(self, system: str, model: str, layers: int | None, seq: int, batch: int, micro_batch: int) -> RunSpec:
        s = self.settings
        return RunSpec(system=system, model=model_label(model, layers), config=model_config(model, layers, seq),
                       seq=seq, batch=batch, micro_batch=micro_batch, steps=s["steps"], warmup=s["warmup"],
                       device=self.device, seed=s["seed"], lr=s["lr"], betas=tuple(s["betas"]), eps=s["eps"],
                       weight_decay=s["weight_decay"], max_grad_norm=s["max_grad_norm"])

    def _not_run_here(self, system: str) -> str | None:
        """Why ``system`` cannot run on this machine, or None."""
        if system not in DEEPSPEED_SYSTEMS:
            return None
        if self.device != "cuda":
            return "not run: needs CUDA"
        if importlib.util.find_spec("deepspeed") is None:
            return "not run: not installed (pip install deepspeed, or its wheels from pip download into .whl/)"
        build = self.settings.get("deepspeed_cpu_adam_build")
        if build is not None and build["status"] != "ok":
            return f"not run: DeepSpeedCPUAdam did not build: {build['status']}"
        return None

    def prepare(self, systems: list[str]) -> None:
        """Build DeepSpeed's CPU Adam once before its runs, when they will run."""
        if not set(DEEPSPEED_SYSTEMS) & set(systems) or self._not_run_here("deepspeed") is not None:
            return
        timeout = 600.0 if self.deadline is None else max(1.0, min(600.0, self.deadline - time.monotonic()))
        echo(f"building DeepSpeedCPUAdam (ninja; up to {timeout:.0f} s)")
        status, seconds = launcher.build_deepspeed_ops(timeout, os.path.join(self.logs, "deepspeed_cpu_adam_build.log"))
        self.settings["deepspeed_cpu_adam_build"] = {"status": status, "seconds": seconds}
        echo(f"  DeepSpeedCPUAdam build: {status} ({seconds:.0f} s)")

    def run(self, spec: RunSpec) -> dict[str, Any]:
        """Run one spec (or find it done, or record why not), add its row, rewrite the report."""
        if spec.key() in self.done:
            row = next(r for r in self.rows if report.run_key(r) == spec.key())
            echo(f"{spec.system} {spec.model} seq {spec.seq}: kept from the earlier report ({row['status']})")
            return row
        shape = self._shape(spec.config)
        remaining = None if self.deadline is None else self.deadline - time.monotonic()
        reason = self._not_run_here(spec.system)
        if reason is None and self.out_of_time():
            reason = f"{BUDGET_NOT_RUN} ran out before this run"
        if reason is not None:
            raw = {"status": reason}
        else:
            timeout = self.run_timeout if remaining is None else min(self.run_timeout, remaining)
            echo(f"{spec.system}: {spec.model} ({report.size(shape.params)}), seq {spec.seq}, batch {spec.batch} "
                 f"(micro {spec.micro_batch}), {spec.steps} steps on {spec.device}; up to {timeout:.0f} s")
            log = os.path.join(self.logs, f"{spec.system}_{spec.model}_seq{spec.seq}.log")
            raw = launcher.launch(spec, timeout, log, echo, budget_end=self.deadline)
            raw["log"] = log
        row = report.derive(spec, raw, shape, self.peak, self.machine.get("gpu"))
        row["run_header"] = report.run_header(self.machine, self.date, self.settings.get("command"))
        self.rows.append(row)
        self.done.add(spec.key())
        self._say(row)
        self.write()
        return row

    def _say(self, row: dict[str, Any]) -> None:
        if row["status"] == "ok":
            echo(f"  {row['system']}: ok, {row['median_step_seconds']:.3f} s/step, {row['tokens_per_second']:,.0f} "
                 f"tokens/s, {row['model_tflops']:.2f} model TFLOP/s, final loss {row['final_loss']:.4f}")
        else:
            echo(f"  {row['system']}: {row['status']}")

    def write(self) -> dict[str, str]:
        self.settings["logs"] = self.logs
        return report.write(report.build(self.machine, self.date, self.settings, self.rows), self.stem)

    # ------------------------------------------------------------------ what to run
    def case(self, systems: list[str], model: str, layers: int | None, seq: int, batch: int,
             micro: int) -> list[dict[str, Any]]:
        """Every system on one case; DeepSpeed ZeRO-3 at each micro-batch of its sweep. Returns the rows."""
        rows = []
        for system in systems:
            # one row says why a system cannot run here; a sweep only where it runs
            micros = micro_batches(system, batch, micro)[:1 if self._not_run_here(system) else None]
            rows += [self.run(self.spec(system, model, layers, seq, batch, m)) for m in micros]
        return rows

    def single(self, systems: list[str], model: str, layers: int | None, seq: int, batch: int, micro: int) -> None:
        self.case(systems, model, layers, seq, batch, micro)

    def sweep(self, systems: list[str], sizes: list[str], seqs: list[int], tokens: int, micro_tokens: int,
              grow_layers: int, max_layers: int) -> None:
        for seq in seqs:
            batch, micro = sweep_batch(seq, tokens, micro_tokens)
            for model in sizes:
                self.case(systems, model, None, seq, batch, micro)
        base = sizes[-1]
        for seq in seqs:
            batch, micro = sweep_batch(seq, tokens, micro_tokens)
            label = model_label(base, None)
            growing = [s for s in systems if self._ok(s, label, seq)]
            layers = MODELS[base]["num_hidden_layers"] + grow_layers
            while growing and layers <= max_layers and grow_layers > 0:
                for system in list(growing):
                    if self.out_of_time():
                        echo("growth stopped: the time budget is spent (--resume goes on from here)")
                        return
                    rows = self.case([system], base, layers, seq, batch, micro)
                    if not any(row["status"] == "ok" for row in rows):
                        growing.remove(system)
                layers += grow_layers

    def out_of_time(self) -> bool:
        return self.deadline is not None and self.deadline - time.monotonic() < MIN_RUN_SECONDS

    def _ok(self, system: str, model: str, seq: int) -> bool:
        return any(r["system"] == system and r["model"] == model and r["seq"] == seq and r["status"] == "ok"
                   for r in self.rows)


def micro_batches(system: str, batch: int, micro: int) -> list[int]:
    """The micro-batches ``system`` runs a case of ``batch`` sequences at: DeepSpeed ZeRO-3's sweep ([Note:
    micro-batch sweep]), every other system the peers' ``micro``."""
    if system != "deepspeed":
        return [micro]
    return [m for m in DEEPSPEED_MICRO_BATCHES if m <= batch and batch % m == 0] or [micro]


def sweep_batch(seq: int, tokens: int, micro_tokens: int) -> tuple[int, int]:
    """Batch and micro-batch (sequences) for ``tokens`` per step at ``seq``; the micro-batch divides the batch."""
    batch = max(1, tokens // seq)
    micro = max(1, min(batch, micro_tokens // seq))
    while batch % micro:
        micro -= 1
    return batch, micro
