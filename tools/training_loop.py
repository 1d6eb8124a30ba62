"""The steps of one ``megatrain-train`` run: metrics rows, evaluations, checkpoints, progress, Ctrl-C.

``train.py`` checks the inputs and builds the engine; this module runs the steps from the run's first to its last
(or to Ctrl-C) and leaves the records for the summary.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import torch

from megatrain.runtime import Engine

from . import data_order, divergence, evaluation, lr_schedule, metric_sinks, metrics, metrics_routing, packing, \
    ranks, run_dir, train_config, world_change
from .interrupt import EXIT_INTERRUPTED, InterruptGuard
from .progress import Progress
from .trace import StepTracer
from .warning_lines import one_line_warnings
from .train_config import TrainConfig, TrainConfigError


class RunState(Protocol):
    """What a loop starts from (``train.Run``): the options, where the run is, the data position, the rank."""

    config: TrainConfig
    out: str
    start_step: int
    rows_done: int
    tokens_done: int
    ranks: ranks.Ranks
    rows: slice


@dataclass
class Pending:
    """A step whose loss is still on the device: read one step later, so the GPU never waits for the host."""

    step: int
    loss: torch.Tensor        # 0-dim fp32, on the device
    grad_norm: torch.Tensor | None
    lr: float
    tokens: int               # tokens predicted in this step (labels not -100 after the shift)
    positions: int            # positions processed in this step (batch x seq_len, padding included)
    breakdown: dict[str, float] | None = None   # the engine's step breakdown, on the steps that read it
    epoch: float = 0.0        # the data's epoch after this step's batch (data_order.TrainingData.epoch)
    evaluation: dict[str, Any] | None = None    # eval_loss, ... when the eval set was evaluated after this step
    finished_at: float | None = None            # when the step was known done (set before an evaluation)
    correct: torch.Tensor | None = None   # [] int64 on the device: this rank's tokens predicted right (argmax)
    own_tokens: int = 0       # this rank's predicted tokens (what ``correct`` is a share of)
    routing: Any = None       # Engine.routing: the experts' token counts and aux loss on the device (MoE)
    objective: torch.Tensor | None = None  # [] fp32 on the device: what the step minimised (loss + coef x aux)



class TrainingLoop:
    """The steps of one run, from its first to its last or to Ctrl-C: metrics rows, checkpoints, progress.

    On a GPU a step's loss is read one step later (``Pending``), so the device never waits for the host.
    """

    def __init__(self, run: RunState, engine: Engine, data: data_order.TrainingData,
                 evals: evaluation.EvalSet | None) -> None:
        c = run.config
        self.config = c
        self.engine = engine
        self.data, self.evals = data, evals
        self.start_step = run.start_step
        self.rows_done = run.rows_done       # data position and tokens predicted, saved with each checkpoint
        self.tokens_done = run.tokens_done
        self.schedule = lr_schedule.from_config(c.lr, c.min_lr, c.warmup_steps, c.total_steps)
        self.peak, self.peak_source = metrics.matmul_peak_tflops(engine.device, dtype_name(engine.compute_dtype))
        self.flops = metrics.TokenFlops.of(engine.config.to_dict(), c.seq_len)
        self.metrics_path = os.path.join(run.out, run_dir.METRICS_FILE)
        self.ckpt_root = os.path.join(run.out, run_dir.CHECKPOINT_DIR)
        self.out = run.out
        self.sink: metric_sinks.MetricSink = metric_sinks.NullSink()  # --log-to: besides metrics.jsonl
        self.tracer = StepTracer(os.path.join(run.out, "trace.json"), run.start_step + 1, c.total_steps,
                                 engine.device) if c.trace and run.ranks.writes else None
        self.records: list[dict[str, Any]] = []
        self.pending: Pending | None = None
        self.ranks, self.rows = run.ranks, run.rows
        self.saved_at: int | None = None
        self.exit_code = 0
        self.watch = divergence.DivergenceWatch(run.start_step + 1, c.total_steps)
        self.diverged: str | None = None  # the line saying the run diverged, when it did
        self.started = self.last_time = time.perf_counter()

    def run(self, batches: Iterator[packing.Batch]) -> None:
        c, engine = self.config, self.engine
        writes = self.ranks.writes  # under torchrun, rank 0 writes the run's files
        log = metrics.MetricsLog(self.metrics_path, append=self.start_step > 0) if writes else ranks.NullLog()
        self.sink = metric_sinks.open(c, self.out, self.start_step) if writes else metric_sinks.NullSink()
        progress = Progress(c.progress if writes else "none", c.total_steps, self.start_step, c.log_every)
        try:
            with InterruptGuard() as interrupt, one_line_warnings(progress.message):
                for step in range(self.start_step + 1, c.total_steps + 1):
                    ids, labels, positions = next_batch(batches)
                    self.rows_done += c.batch
                    lr = self.schedule.lr(step)
                    if self.tracer is not None:
                        self.tracer.before_step(step)
                    # The one place the step's time breakdown is asked for and read: every log_every steps,
                    # into that step's metrics row (untimed steps record no timing events; on CUDA reading it
                    # waits for that step).
                    timed = step % c.log_every == 0
                    if timed:
                        engine.time_next_step()
                    objective = engine.step(ids[self.rows], labels[self.rows], lr=lr,  # this rank's rows
                                            position_ids=None if positions is None else positions[self.rows],
                                            padding=self.data.padding()[self.rows])
                    breakdown = engine.last_step_breakdown if timed else None
                    launched = Pending(step, engine.lm_loss, engine.grad_norm, lr, int((labels[:, 1:] != -100).sum()),
                                       ids.numel(), breakdown, self.data.epoch)
                    launched.objective = objective
                    launched.correct = engine.correct_tokens  # read with the loss, one step later
                    launched.routing = engine.routing
                    launched.own_tokens = int((labels[self.rows][:, 1:] != -100).sum())
                    self._flush(log, progress)
                    self.pending = launched
                    if self.evals is not None and not interrupt.requested and (
                            step == c.total_steps or (c.eval_every and step % c.eval_every == 0)):
                        self._evaluate(launched, progress)
                    if engine.device.type != "cuda":  # a CPU step is done when step() returns: no lag to gain
                        self._flush(log, progress)
                    if self.tracer is not None:
                        self.tracer.after_step(step, engine.synchronize)
                    line = self.watch.diverged(engine.skipped_steps)
                    # Under torchrun every rank stops at the same step, for Ctrl-C or divergence: one all-reduce
                    diverged, stop = self.ranks.any_each(line is not None, interrupt.requested)
                    if diverged:
                        self._flush(log, progress)
                        self._stop_diverged(line, progress)
                        break
                    if stop or (c.save_every and step % c.save_every == 0 and step < c.total_steps):
                        self._flush(log, progress)
                        log.sync()  # the rows up to the checkpoint on the disk with it
                        self._save(step, blocking=stop)
                    if stop:
                        self.exit_code = EXIT_INTERRUPTED
                        progress.message(f"interrupted at step {step}; checkpoint saved in {self.ckpt_root}")
                        break
                else:
                    self._flush(log, progress)
                    engine.synchronize()  # the last steps' skipped updates reported
                    line = self.watch.diverged(engine.skipped_steps)
                    if self.ranks.any(line is not None):
                        self._stop_diverged(line, progress)
                    else:
                        log.sync()
                        self._save(c.total_steps, blocking=True)
                engine.synchronize()  # every skipped update reported here, as one line
                engine.wait_for_checkpoint()
        except BaseException:
            self.sink.close()  # the run failed: no summary (else the run closes the sink with its summary)
            raise
        finally:
            progress.close()
            log.close()
            if writes and self.start_step == 0 and not self.records:  # stopped before its first step: --out as it
                metrics.remove_if_empty(self.metrics_path)            # was (train.py removes the rest)
            if self.tracer is not None:
                self.tracer.close(engine.synchronize)

    def _stop_diverged(self, line: str | None, progress: Progress) -> None:
        """The run stops (exit status 3, no checkpoint): its recent updates were all skipped, on this rank (``line``)
        or on another, whose AdamW worker reported them sooner (None)."""
        self.diverged = line or divergence.elsewhere()
        self.exit_code = divergence.EXIT_DIVERGED
        if self.ranks.writes:
            progress.message(f"megatrain-train: error: {self.diverged}")

    def outcome(self) -> dict[str, Any]:
        """summary.json's exit status and skipped steps."""
        return {"exit_code": self.exit_code, **divergence.figures(self.engine.skipped_steps, self.diverged)}

    def _flush(self, log: metrics.MetricsLog, progress: Progress) -> None:
        """Read the pending step's numbers (waits for that step only) and record them."""
        p, self.pending = self.pending, None
        if p is None:
            return
        loss = float(p.loss.item())
        now = time.perf_counter()
        dt = (p.finished_at or now) - self.last_time  # an evaluation after the step is not the step's time
        self.last_time = now
        self.tokens_done += p.tokens
        # Throughput counts positions processed (the work done); the loss averages over the labelled tokens.
        tps = p.positions / dt if dt > 0 else 0.0
        record: dict[str, Any] = {
            "step": p.step, "loss": loss, "tokens_per_second": tps, "lr": p.lr,
            "grad_norm": float(p.grad_norm.item()) if p.grad_norm is not None else None,
            "tokens": p.step * p.positions, "step_tokens": p.positions,
            "trained_tokens": self.tokens_done, "step_trained_tokens": p.tokens, "step_time_s": dt,
            "token_accuracy": int(p.correct.item()) / p.own_tokens if p.correct is not None and p.own_tokens
            else None,
            "elapsed_s": now - self.started, **self.flops.figures(tps, self.peak),
            "gpu_memory_bytes": metrics.gpu_peak_bytes(self.engine.device),
            "host_memory_bytes": metrics.host_peak_bytes(), "epoch": p.epoch,
        }
        if p.routing is not None:
            record.update(metrics_routing.figures(p.routing))
            if "aux_loss" in record and p.objective is not None:  # the total the step minimised
                record["train_objective"] = float(p.objective.item())
        if p.evaluation is not None:
            record.update(p.evaluation)
        if p.breakdown is not None:
            record["breakdown"] = p.breakdown
        self.records.append(record)
        log.write(record)
        self.sink.log(p.step, record)
        progress.update(record)

    def _evaluate(self, p: Pending, progress: Progress) -> None:
        """The eval set's loss with the weights after step p (the step's own time measured first)."""
        assert self.evals is not None
        p.loss.item()  # waits for the step on a GPU
        p.finished_at = time.perf_counter()
        p.evaluation = self.evals.evaluate(self.engine)
        if self.ranks.writes:  # rank 0 reports
            progress.message(evaluation.describe(p.step, p.evaluation))

    def _save(self, step: int, blocking: bool) -> None:
        extra = {"step": step, "rows_done": self.rows_done, "tokens_done": self.tokens_done,
                 "data": self.data.state(),
                 "schedule": self.schedule.to_dict(), "train_config": train_config.absolute_paths(self.config),
                 "torch_rng": torch.get_rng_state().tolist(), world_change.WORLD_SIZE_KEY: self.ranks.world_size}
        handle = self.engine.save_checkpoint(self.ckpt_root, extra=extra, keep=self.config.keep, blocking=blocking)
        if blocking and handle is not None:
            handle.wait()
        self.saved_at = step


def next_batch(batch_iter: Iterator[packing.Batch]) -> packing.Batch:
    batch = next(batch_iter, None)
    if batch is None:
        raise TrainConfigError("data: no tokens to train on (the data is empty); check --data and --text-field")
    return batch


def dtype_name(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp32"
