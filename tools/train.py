"""``megatrain-train``: train a language model with fp32 masters and AdamW state in host memory.

    megatrain-train                                   # the demo: a ~3M-parameter model on Python's pydoc text
    megatrain-train --model path/to/hf_model --data corpus.jsonl --tokenizer path/to/hf_model/tokenizer.json \\
                    --seq-len 2048 --batch 16 --lr 1e-5 --tokens 100_000_000 --save-every 500 --out run1
    megatrain-train --config run.toml --steps 2000    # the same keys in a TOML file; the command line wins
    megatrain-train --resume run1                     # continue where run1 stopped (its settings, plus yours)

Writes OUT/metrics.jsonl (one line per step), OUT/summary.json, OUT/checkpoints/, OUT/training.png
(with matplotlib) and OUT/trace.json (--trace). Ctrl-C saves a checkpoint and exits with status 130;
a second Ctrl-C exits at once. A bad option or input: one line on stderr, status 2.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from megatrain.planner import model_shapes, search
from megatrain.planner.hardware import HardwareError
from megatrain.planner.plan import Plan, PlanError
from megatrain.planner.profiler import detect
from megatrain.planner.workload import Workload, WorkloadError
from megatrain.runtime import Engine, MegatrainError, ModelConfig, OptimizerConfig

from . import lr_schedule, metrics, model_source, packing, tokenizer as tokenizers, train_config
from .data import Corpus
from .interrupt import EXIT_INTERRUPTED, InterruptGuard
from .plot import plot
from .progress import Progress
from .trace import StepTracer
from .train_config import TrainConfig, TrainConfigError

EXIT_USAGE = 2
# Errors a person fixes by changing an option or a file: printed as one line, exit status 2.
USER_ERRORS = (MegatrainError, PlanError, WorkloadError, HardwareError, model_shapes.ModelShapeError,
               search.InfeasibleError)
CHECKPOINT_DIR = "checkpoints"


def main(argv: list[str] | None = None) -> int:
    try:
        values = train_config.read_values(argv)
        config = train_config.build(values)
        return Run(config, values).execute()
    except USER_ERRORS as e:
        print(f"megatrain-train: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:  # before training started (during setup): nothing to save
        print("\nmegatrain-train: interrupted before training started", file=sys.stderr)
        return EXIT_INTERRUPTED


@dataclass
class Pending:
    """A step whose loss is still on the device: read one step later, so the GPU never waits for the host."""

    step: int
    loss: torch.Tensor        # 0-dim fp32, on the device
    grad_norm: torch.Tensor | None
    lr: float
    tokens: int               # tokens predicted in this step (labels not -100 after the shift)


class Run:
    """One invocation: set up, train, finish. ``values`` are the options given explicitly (for --resume)."""

    def __init__(self, config: TrainConfig, values: dict[str, Any]) -> None:
        self.config = config
        self.values = values
        self.out = config.out
        self.notes: list[str] = []

    # ------------------------------------------------------------------ setup
    def execute(self) -> int:
        resume_dir = _checkpoint_root(self.config.resume) if self.config.resume else None
        device = _device(self.config.device)
        if resume_dir is not None:
            engine = self._resume(resume_dir, device)
        else:
            engine = self._new_engine(device)
        try:
            return self._train(engine)
        finally:
            engine.close()

    def _new_engine(self, device: torch.device) -> Engine:
        c = self.config
        self.tokenizer = tokenizers.load(c.tokenizer, c.separator_id)
        source = model_source.resolve(c.model, self.tokenizer.vocab_size, c.seq_len)
        dtype = _compute_dtype(c.compute_dtype, device)
        plan = self._with_spill(self._plan(source.config, dtype))
        optimizer = _optimizer(c)
        if source.pretrained is not None:
            if not hasattr(Engine, "from_pretrained"):
                raise TrainConfigError(f"model: loading weights from {source.pretrained} needs "
                                       f"Engine.from_pretrained, which this megatrain lacks (issue #4)")
            engine = Engine.from_pretrained(source.pretrained, optimizer=optimizer, plan=plan, compute_dtype=dtype,
                                            device=device)
        else:
            engine = Engine(source.config, optimizer=optimizer, plan=plan, compute_dtype=dtype, device=device,
                            seed=c.seed)
        self.model_description = source.description
        self.start_step, self.rows_done, self.tokens_done = 0, 0, 0
        return engine

    def _resume(self, root: str, device: torch.device) -> Engine:
        if not hasattr(Engine, "load_checkpoint"):
            raise TrainConfigError("resume: this megatrain has no Engine.load_checkpoint yet (issue #4)")
        plan = Plan.load(self.values["plan"]) if self.values.get("plan") else None
        if plan is not None:
            plan = self._with_spill(plan)
        engine = Engine.load_checkpoint(root, device=device, plan=plan)
        extra = dict(getattr(engine, "checkpoint_extra", None) or {})
        if "train_config" not in extra:
            engine.close()
            raise TrainConfigError(f"resume: {root} was not written by megatrain-train (no training state); "
                                   f"load it with Engine.load_checkpoint in your own loop")
        # The saved run's settings, with the options given now on top.
        saved = dict(extra["train_config"])
        saved.update(self.values)
        saved["resume"] = self.config.resume
        self.config = train_config.build(saved)
        self.out = self.config.out
        self.tokenizer = tokenizers.load(self.config.tokenizer, self.config.separator_id)
        self.start_step = int(extra["step"])
        self.rows_done = int(extra["rows_done"])
        self.tokens_done = int(extra["tokens_done"])
        if engine.step_count != self.start_step:
            self.notes.append(f"engine step {engine.step_count} differs from the saved run step {self.start_step}")
        if "torch_rng" in extra:
            torch.set_rng_state(torch.tensor(extra["torch_rng"], dtype=torch.uint8))
        self.model_description = f"resumed from {root} at step {self.start_step}"
        return engine

    def _plan(self, model: ModelConfig, dtype: torch.dtype) -> Plan:
        c = self.config
        if c.plan:
            self.plan_description = c.plan
            return Plan.load(c.plan)
        work = Workload(c.seq_len, c.batch, compute_dtype="bf16" if dtype == torch.bfloat16 else "fp32",
                        clipping=c.max_grad_norm > 0)
        result = search.search(model_shapes.from_config(model.to_dict()), work, detect())
        plan = result.require().plan
        self.plan_description = (f"planner: micro-batch {plan.micro_batch_size}, {plan.num_slots} slots, "
                                 f"checkpoints on {plan.checkpoints}, {plan.optimizer_mode} optimizer")
        return plan

    def _with_spill(self, plan: Plan) -> Plan:
        """--spill-dir: the plan's spill files go there; a plan that spills nothing spills the AdamW state."""
        if not self.config.spill_dir:
            return plan
        if "spill_dir" not in {f.name for f in dataclasses.fields(Plan)}:
            raise TrainConfigError("spill_dir: this megatrain's runtime has no NVMe tier yet (issue #6); "
                                   "leave --spill-dir out")
        os.makedirs(self.config.spill_dir, exist_ok=True)
        spill = plan.spill if plan.spill != "none" else "optimizer"
        self.plan_description = f"{getattr(self, 'plan_description', 'saved plan')}, spilling {spill} to " \
                                f"{self.config.spill_dir}"
        return plan.replace(spill=spill, spill_dir=self.config.spill_dir)

    # ------------------------------------------------------------------ training
    def _train(self, engine: Engine) -> int:
        c = self.config
        total = c.total_steps
        if self.start_step >= total:
            raise TrainConfigError(f"steps: the checkpoint is at step {self.start_step} already; raise --steps "
                                   f"(now {total}) to train further")
        os.makedirs(self.out, exist_ok=True)
        corpus = Corpus(c.data, self.tokenizer, c.text_field, c.token_dtype)
        rows = packing.pack(packing.repeat_epochs(corpus.documents), c.seq_len, self.tokenizer.separator_id)
        batch_iter = packing.batches(rows, c.batch, skip_rows=self.rows_done)
        schedule = lr_schedule.from_config(c.lr, c.min_lr, c.warmup_steps, total)
        peak, peak_source = metrics.matmul_peak_tflops(engine.device, _dtype_name(engine.compute_dtype))
        n_params = engine.num_parameters
        can_save = hasattr(engine, "save_checkpoint")
        if not can_save:
            self.notes.append("checkpoints not saved: this megatrain has no Engine.save_checkpoint yet (issue #4)")
        print(f"megatrain-train: {n_params / 1e6:.2f}M parameters ({self.model_description}) on {engine.device} "
              f"in {_dtype_name(engine.compute_dtype)}; data: {corpus.describe()}; {total} steps of "
              f"{c.batch} x {c.seq_len} tokens; plan: {getattr(self, 'plan_description', 'from the checkpoint')}; "
              f"output: {self.out}", file=sys.stderr, flush=True)

        metrics_path = os.path.join(self.out, "metrics.jsonl")
        log = metrics.MetricsLog(metrics_path, append=self.start_step > 0)
        progress = Progress(c.progress, total, self.start_step, c.log_every)
        tracer = StepTracer(os.path.join(self.out, "trace.json"), self.start_step + 1, total, engine.device) \
            if c.trace else None
        records: list[dict[str, Any]] = []
        state = {"last_time": time.perf_counter(), "start": time.perf_counter()}
        ckpt_root = os.path.join(self.out, CHECKPOINT_DIR)
        saved_at: int | None = None
        exit_code = 0

        def finish(p: Pending) -> None:
            """Read a step's numbers (waits for that step only) and record them."""
            loss = float(p.loss.item())
            now = time.perf_counter()
            dt = now - state["last_time"]
            state["last_time"] = now
            self.tokens_done += p.tokens
            tps = p.tokens / dt if dt > 0 else 0.0
            tflops = 6 * n_params * tps / 1e12
            record = {
                "step": p.step, "loss": loss, "tokens_per_second": tps, "lr": p.lr,
                "grad_norm": float(p.grad_norm.item()) if p.grad_norm is not None else None,
                "tokens": self.tokens_done, "step_tokens": p.tokens, "step_time_s": dt,
                "elapsed_s": now - state["start"], "model_tflops": tflops,
                "mfu": tflops / peak if peak else None,
                "gpu_memory_bytes": metrics.gpu_peak_bytes(engine.device),
                "host_memory_bytes": metrics.host_peak_bytes(),
            }
            records.append(record)
            log.write(record)
            progress.update(record)

        def save(step: int, blocking: bool) -> None:
            nonlocal saved_at
            if not can_save:
                return
            extra = {"step": step, "rows_done": self.rows_done, "tokens_done": self.tokens_done,
                     "schedule": schedule.to_dict(), "train_config": c.to_dict(),
                     "torch_rng": torch.get_rng_state().tolist(), "metrics": os.path.abspath(metrics_path)}
            handle = engine.save_checkpoint(ckpt_root, extra=extra, keep=c.keep, blocking=blocking)
            if blocking and handle is not None and hasattr(handle, "wait"):
                handle.wait()
            saved_at = step

        pending: Pending | None = None
        try:
            with InterruptGuard() as interrupt:
                for step in range(self.start_step + 1, total + 1):
                    ids, labels = _next_batch(batch_iter)
                    self.rows_done += c.batch
                    lr = schedule.lr(step)
                    if tracer is not None:
                        tracer.before_step(step)
                    loss = engine.step(ids, labels, lr=lr)
                    launched = Pending(step, loss, engine.grad_norm, lr, int((labels[:, 1:] != -100).sum()))
                    if pending is not None:
                        finish(pending)
                    pending = launched
                    if engine.device.type != "cuda":  # a CPU step is done when step() returns: no lag to gain
                        finish(pending)
                        pending = None
                    if tracer is not None:
                        tracer.after_step(step, engine.synchronize)
                    if interrupt.requested or (c.save_every and step % c.save_every == 0 and step < total):
                        if pending is not None:
                            finish(pending)
                            pending = None
                        save(step, blocking=interrupt.requested)
                    if interrupt.requested:
                        exit_code = EXIT_INTERRUPTED
                        progress.message(f"interrupted at step {step}"
                                         + (f"; checkpoint saved in {ckpt_root}" if can_save else ""))
                        break
                else:
                    if pending is not None:
                        finish(pending)
                        pending = None
                    save(total, blocking=True)
                if can_save and hasattr(engine, "wait_for_checkpoint"):
                    engine.wait_for_checkpoint()
        finally:
            progress.close()
            log.close()
            if tracer is not None:
                tracer.close(engine.synchronize)

        engine.synchronize()
        summary = metrics.summarize(records, n_params, peak, engine.device, {
            "peak_source": peak_source, "out": os.path.abspath(self.out), "metrics": metrics_path,
            "checkpoint": (f"{ckpt_root} (step {saved_at})" if saved_at is not None else
                           "none" + ("" if can_save else " (this megatrain cannot save checkpoints yet)")),
            "trace": tracer.describe() if tracer is not None else None,
            "exit_code": exit_code, "notes": self.notes,
        })
        summary["plot"] = plot(metrics.read_metrics(metrics_path), os.path.join(self.out, "training.png")) \
            if c.plot else "off (--no-plot)"
        metrics.write_summary(os.path.join(self.out, "summary.json"), summary)
        print(metrics.format_summary(summary), file=sys.stderr)
        for note in self.notes:
            print(f"note: {note}", file=sys.stderr)
        return exit_code


def _next_batch(batch_iter: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = next(batch_iter, None)
    if batch is None:
        raise TrainConfigError("data: no tokens to train on (the data is empty); check --data and --text-field")
    return batch


def _checkpoint_root(path: str) -> str:
    """An earlier run's --out holds its checkpoints in a subdirectory; accept either."""
    inner = os.path.join(path, CHECKPOINT_DIR)
    return inner if os.path.isdir(inner) else path


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainConfigError("device=cuda but torch sees no CUDA GPU; use --device auto or cpu")
    return torch.device(name)


def _compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on a GPU; fp32 on a CPU, whose bf16 matmuls are slow."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def _dtype_name(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def _optimizer(c: TrainConfig) -> OptimizerConfig:
    return OptimizerConfig(lr=c.lr, betas=(c.beta1, c.beta2), weight_decay=c.weight_decay,
                           max_grad_norm=c.max_grad_norm if c.max_grad_norm > 0 else None, no_decay=("norm", "bias"))


if __name__ == "__main__":
    sys.exit(main())
