"""``megatrain-train``: train a language model with fp32 masters and AdamW state in host memory.

    megatrain-train                                   # the demo: a ~3M-parameter model on Python's pydoc text
    megatrain-train --model path/to/hf_model --data corpus.jsonl --tokenizer path/to/hf_model/tokenizer.json \\
                    --seq-len 2048 --batch 16 --lr 1e-5 --tokens 100_000_000 --save-every 500 --out run1
    megatrain-train --config run.toml --steps 2000    # the same keys in a TOML file; the command line wins
    megatrain-train --resume run1                     # continue where run1 stopped (its settings, plus yours)

Writes OUT/metrics.jsonl (a line per step, with the held-out loss after each evaluation), OUT/summary.json, OUT/run.json
(the options), OUT/checkpoints/, OUT/training.png (with matplotlib), OUT/trace.json (--trace), OUT/tensorboard/ and
OUT/wandb/ (--log-to) and, with --export-on-finish DIR, a Hugging Face directory DIR at the end. Progress and warnings
go to stderr, the summary to stdout (and stderr). The data order is tools/data_order.py's, evaluation
tools/evaluation.py's, the steps tools/training_loop.py's. OUT must be new or empty (--overwrite replaces an earlier
run's files; --resume continues it, in its own directory); see tools/run_dir.py. Ctrl-C saves a checkpoint and exits
with status 130 (also during start-up, with nothing written yet); a second Ctrl-C exits at once. A bad option or input:
one line on stderr, status 2, before anything is written.
A diverged run: status 3 (tools/divergence.py); a disk that fills up or fails: status 74 (tools/io_failure.py).
"""
from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterator

from .interrupt import EXIT_INTERRUPTED, INTERRUPTED_AT_START, start_up

with start_up(command=__name__ == "__main__" or os.path.basename(sys.argv[0]) == "megatrain-train"):
    import torch

    from megatrain.planner.shapes import model_shapes
    from megatrain.planner.choice import search
    from megatrain.planner.profiling.hardware import HardwareError
    from megatrain.plan.plan import Plan, PlanError
    from megatrain.planner.shapes.workload import WorkloadError
    from megatrain.runtime import Engine, MegatrainError, ModelConfig, OptimizerConfig, keep_freed_heap
    from megatrain.runtime.distributed.process_group import exit_process

    from . import data_order, evaluation, export, io_failure, metric_sinks, metrics, model_source, packing, \
        progress, ranks, restart, resume, run_dir, run_inputs, run_limits, tokenizer as tokenizers, tokenizer_check, \
        train_config, train_options, world_change
    from .data import Corpus
    from .plot import plot
    from .training_loop import TrainingLoop, dtype_name, next_batch
    from .warning_lines import one_line_warnings
    from .train_config import TrainConfig, TrainConfigError

EXIT_USAGE = 2
# Errors a person fixes by changing an option or a file: printed as one line, exit status 2. The planner's
# errors are ValueError subclasses with one-line messages (caught by their module, see main).
USER_ERRORS = (MegatrainError, PlanError, WorkloadError, HardwareError, model_shapes.ModelShapeError,
               search.InfeasibleError)
# What a rank stops for while checking inputs: reported by every rank, as one line (tools/ranks.py).
CHECK_ERRORS = (*USER_ERRORS, ValueError, OSError)


def main(argv: list[str] | None = None) -> int:
    try:
        rank_set = ranks.Ranks.join(ranks.collective_timeout(argv))  # under torchrun: this rank; every rank checks
        # the options alike
        try:
            values, config = rank_set.agree(lambda: _options(argv), CHECK_ERRORS)
        except restart.RunFinished as e:  # a requeued run that had finished: every rank sees the same checkpoint
            if rank_set.writes:
                print(f"megatrain-train: {e}", file=sys.stderr)
            return 0
        with one_line_warnings(lambda line: print(line, file=sys.stderr)):  # the library's warnings: one line
            return Run(config, values, rank_set).execute()
    except USER_ERRORS as e:
        return _usage_error(str(e))
    except ValueError as e:
        if not type(e).__module__.startswith("megatrain."):
            raise
        return _usage_error(str(e))
    except OSError as e:  # a path the checks could not foresee (status 2), or a disk failing under the run (74)
        return _usage_error(io_failure.line(e), io_failure.exit_status(e))
    except RuntimeError as e:  # under torchrun: another rank stopped (it printed why) or stopped answering
        if not ranks.peer_failure(e):
            raise
        print(f"megatrain-train: error: {ranks.peer_stopped(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before training started (during setup): nothing to save
        sys.stderr.write(INTERRUPTED_AT_START)
        return EXIT_INTERRUPTED


def _options(argv: list[str] | None) -> tuple[dict[str, Any], TrainConfig]:
    values = train_options.read_values(argv)
    return restart.resolve(values, train_config.build(values))  # --resume-or-start: resume, start over or start


def _usage_error(message: str, status: int = EXIT_USAGE) -> int:
    print(f"megatrain-train: error: {message.splitlines()[0] if message else 'invalid input'}", file=sys.stderr)
    return status


@dataclass
class Setup:
    """What ``Run._setup`` checked before anything is written: the model, the data, the plan, where it runs."""

    own_run: bool             # it resumes its own run, in its own directory
    overwrite: bool
    device: torch.device      # --device resolved once, here; the Engine is handed it and the rest reads engine.device
    dtype: torch.dtype
    model: ModelConfig
    source: model_source.ModelSource | None   # None: resumed (the checkpoint holds the weights)
    corpus: Corpus
    batches: Iterator[packing.Batch]   # the first batch (already read) included
    plan: Plan
    data: data_order.TrainingData                          # the data position, the epoch
    evals: evaluation.EvalSet | None
    collective_timeout_s: float | None   # under torchrun: --collective-timeout, else the plan's bound


class Run:
    """One invocation. ``execute``: read and check every input (``_setup``), then take the run directory and
    train (``_run``: the loop is ``TrainingLoop``), then write the summary (``_finish``).

    Nothing is written before every input (options, resume checkpoint, tokenizer, model, data, plan, output
    and spill directories) has been checked. ``values`` are the options given explicitly.
    """

    def __init__(self, config: TrainConfig, values: dict[str, Any], rank_set: "ranks.Ranks | None" = None) -> None:
        self.config = config
        self.values = values
        self.out = config.out
        self.notes: list[str] = []
        self.resumed: resume.Resumed | None = None
        self.changes: list[str] = []  # options a resume changes, "name old -> new"
        self.warnings: list[str] = []
        self.plan_description = ""
        self.model_description = ""
        # Where the run starts: 0 for a new run, the checkpoint's position for a resumed one.
        self.start_step = 0
        self.rows_done = 0
        self.tokens_done = 0
        self.packing = "concat"  # --packing resolved against the data (see _setup)
        self.data_state: dict[str, Any] | None = None  # the data position a resumed checkpoint kept
        self.ranks = rank_set or ranks.Ranks(None)  # under torchrun: this process's rank (tools/ranks.py)
        self.rows = slice(None)  # this rank's rows of each global batch

    def execute(self) -> int:
        # Every rank checks every input; an error on any rank stops all of them with its line.
        setup = self.ranks.agree(self._setup, CHECK_ERRORS)
        self.ranks.same({"plan": {**setup.plan.to_dict(), "spill_dir": None}, "data order": setup.data.state(),
                         "start step": self.start_step, "options": train_config.compared_options(self.config)})
        self.ranks.set_timeout(setup.collective_timeout_s)  # the setup's waited --collective-timeout or 300 s
        return self._run(setup)

    # ------------------------------------------------------------------ setup
    def _setup(self) -> Setup:
        """Every input read and checked; nothing written."""
        if self.config.resume:
            self._read_resume()
        c = self.config
        if self.resumed is not None and self.start_step >= c.total_steps:
            raise TrainConfigError(f"steps: the checkpoint is at step {self.start_step} already; raise --steps "
                                   f"(now {c.total_steps}) to train further")
        overwrite = bool(self.values.get("overwrite")) or restart.killed_at_start(self.out, c)  # its leftovers
        own_run = self._check_run_dir(self.out, overwrite)
        device = self.ranks.device(_device(c.device))
        self.rows = self.ranks.rows(c.batch)
        dtype = _compute_dtype(c.compute_dtype, device)
        tokenizer, model, source = self._check_model()
        moved = None if self.resumed is None or c.plan else world_change.replan(
            self.resumed.extra, self.resumed.plan, c.batch, self.ranks.world_size)
        if moved:  # a resume at another world size plans again for the new per-rank batch
            self.changes.append(moved)
        chosen = run_limits.choose(c, self.values, self.out, self.resumed.plan if self.resumed else None, model,
                                   dtype_name(dtype), self.ranks.topology, moved is not None, device.type == "cpu")
        corpus = Corpus(c.data, tokenizer, c.text_field, c.token_dtype, c.train_on)
        corpus.check_token_ids(model.vocab_size)
        if self.resumed is None and "tokenizer" not in self.values:  # the model directory's, not one chosen
            tokenizer_check.check(tokenizer, c.data, c.text_field, c.token_dtype, c.train_on)
        metric_sinks.check(c)
        self.packing = data_order.packing_mode(c.packing, corpus)
        data, held_out = data_order.training_data(c, corpus, tokenizer.separator_id, self.data_state, self.rows_done,
                                                  self.packing)
        batches = data.batches()
        first = next_batch(batches)  # the data yields a batch: checked before anything is written
        evals = evaluation.eval_set(c, corpus, data.addresses, held_out, tokenizer.separator_id, model.vocab_size,
                                    self.packing)
        plan, self.plan_description = chosen.plan, chosen.description
        self.notes += chosen.notes
        return Setup(own_run, overwrite, device, dtype, model, source, corpus, itertools.chain([first], batches),
                     plan, data, evals, chosen.collective_timeout_s)

    def _run(self, setup: Setup) -> int:
        """Take the run directory (and the spill directory), build the engine, train, write the summary."""
        out, plan = self.out, setup.plan
        created = spill_created = False
        lock = run_dir.RunLock(out)

        def take_directories() -> None:  # rank 0 (or the one process) alone; the other ranks wait for it
            nonlocal created, spill_created
            created = run_dir.make_dir("out", out)
            lock.acquire(lambda line: print(f"megatrain-train: {line}", file=sys.stderr))
            self._say_warnings()
            if plan.spill != "none":
                assert plan.spill_dir is not None
                spill_created = run_dir.make_dir("spill_dir", plan.spill_dir)  # before --overwrite deletes anything
            if setup.overwrite:
                removed = run_dir.remove_run_files(out)
                if removed:
                    print(f"megatrain-train: --overwrite: deleted the earlier run's {', '.join(removed)} in {out}",
                          file=sys.stderr)
            restart.record(out, self.config)  # what --resume-or-start compares a restart's options with
        try:
            self.ranks.take_run_directory(take_directories, lock.path, CHECK_ERRORS)  # one --out every node sees

            def local_spill_dir() -> None:  # a node-local --spill-dir: the other nodes' ranks make their own
                nonlocal spill_created
                if not self.ranks.writes and plan.spill != "none" and plan.spill_dir is not None:
                    spill_created = run_dir.make_dir("spill_dir", plan.spill_dir)
            self.ranks.agree(local_spill_dir, CHECK_ERRORS)
            engine = self._engine(plan, setup.dtype, setup.device, setup.source)
            try:
                if not self.ranks.writes:  # the run's files are rank 0's
                    follower = TrainingLoop(self, engine, setup.data, setup.evals)
                    follower.run(setup.batches)
                    return follower.exit_code
                if setup.own_run:
                    dropped = metrics.truncate_after(os.path.join(out, run_dir.METRICS_FILE), self.start_step)
                    if dropped:
                        self.notes.append(f"dropped {dropped} metrics row(s) after step {self.start_step} "
                                          f"(the run continues from its checkpoint)")
                self._banner(engine, setup)
                loop = TrainingLoop(self, engine, setup.data, setup.evals)
                loop.run(setup.batches)
                summary = self._summary(engine, loop, plan)
            finally:
                engine.close()
            self.ranks.leave()  # the export is rank 0's alone, as one process: the other ranks may have exited
            return self._finish(summary, loop)  # the engine's memory is free for the export
        finally:
            lock.release()
            # A run that wrote nothing (it stopped before its first step) leaves no directory it made behind.
            if spill_created and plan.spill_dir is not None and not run_dir.existing_entries(plan.spill_dir):
                os.rmdir(plan.spill_dir)
            restart.drop_lone_record(out)  # after the spill directory: OUT/spill may be what kept OUT non-empty
            if created and not run_dir.existing_entries(out):
                os.rmdir(out)

    def _say_warnings(self) -> None:
        """Said once every input is known good, so that a refusal stays one line."""
        for warning in self.warnings:
            print(f"megatrain-train: warning: {warning}", file=sys.stderr)
        for change in self.changes:
            print(f"megatrain-train: resume: {change}", file=sys.stderr)
        self.notes += self.warnings + [f"changed on resume: {change}" for change in self.changes]

    def _check_run_dir(self, out: str, overwrite: bool) -> bool:
        """May this run write into ``out``? True when it resumes its own run there. Writes nothing."""
        c = self.config
        run_dir.check_writable_dir("out", out)
        if c.spill_dir:
            run_dir.check_writable_dir("spill_dir", c.spill_dir)
        run_dir.refuse_if_running(out)
        if c.export_on_finish:  # checked now, not after the training
            run_dir.check_writable_dir("export_on_finish", c.export_on_finish)
            export.check_target(c.export_on_finish, {"out": out, "spill_dir": c.spill_dir}, "export_on_finish")
        own_run = self.resumed is not None and self.resumed.run is not None and _same_dir(self.resumed.run, out)
        if own_run:
            if overwrite:
                raise TrainConfigError(f"overwrite: {out} is the run being resumed, and --overwrite would delete "
                                       f"its checkpoints; leave --overwrite out")
            resume.refuse_branching(out, self.start_step)
        elif not overwrite:
            run_dir.refuse_existing(out, resumable=os.path.isdir(os.path.join(out, run_dir.CHECKPOINT_DIR)))
        else:  # nothing the run reads may be in what --overwrite deletes
            run_inputs.refuse_inputs_in(out, run_inputs.inputs(c, self.values.get("config"),
                                                               self.resumed.path if self.resumed else None))
        return own_run

    def _check_model(self) -> tuple[tokenizers.Tokenizer, ModelConfig, model_source.ModelSource | None]:
        """The tokenizer and the model (the resumed run's, or --model's source), checked against each other."""
        c = self.config
        tokenizer = tokenizers.load(c.tokenizer, c.separator_id)
        if self.resumed is not None:
            model, source = self.resumed.model, None
            if tokenizer.vocab_size > model.vocab_size:
                raise TrainConfigError(f"tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size "
                                       f"is {model.vocab_size}; resume with the run's own tokenizer")
        else:
            source = model_source.resolve(c.model, tokenizer.vocab_size, c.seq_len, c.init, c.revision)
            model = source.config
        if tokenizer.separator_id >= model.vocab_size:
            raise TrainConfigError(f"separator_id={tokenizer.separator_id} is outside the model's vocabulary "
                                   f"(ids 0..{model.vocab_size - 1}); pass an id the model has, or -1")
        warning = model_source.position_warning(model, c.seq_len)
        if warning:
            self.warnings.append(warning)
        return tokenizer, model, source

    def _read_resume(self) -> None:
        """The checkpoint, its run directory and its settings with the options given now on top."""
        r = resume.read(self.config, self.values)
        self.resumed, self.config, self.out, self.changes = r, r.config, r.out, r.changes
        self.start_step, self.rows_done, self.tokens_done, self.data_state = r.step, r.rows_done, r.tokens_done, r.data

    def _engine(self, plan: Plan, dtype: torch.dtype, device: torch.device,
                source: model_source.ModelSource | None) -> Engine:
        c = self.config
        if self.resumed is not None:
            engine = Engine.load_checkpoint(self.resumed.path, device=device, plan=plan)
            extra = self.resumed.extra
            if engine.step_count != self.start_step:
                self.notes.append(f"engine step {engine.step_count} differs from the saved run step {self.start_step}")
            if "torch_rng" in extra:
                torch.set_rng_state(torch.tensor(extra["torch_rng"], dtype=torch.uint8))
            self.model_description = f"resumed from {self.resumed.path} at step {self.start_step}"
            return engine
        assert source is not None
        optimizer = _optimizer(c)
        if source.pretrained is not None:
            engine = Engine.from_pretrained(source.pretrained, optimizer=optimizer, plan=plan, compute_dtype=dtype,
                                            device=device)
        else:
            engine = Engine(source.config, optimizer=optimizer, plan=plan, compute_dtype=dtype, device=device,
                            seed=c.seed)
        self.model_description = source.description
        return engine

    # ------------------------------------------------------------------ training
    def _banner(self, engine: Engine, setup: Setup) -> None:
        c = self.config
        print(f"megatrain-train: {engine.num_parameters / 1e6:.2f}M parameters ({self.model_description}) on "
              f"{engine.device} in {dtype_name(engine.compute_dtype)}; data: {setup.data.describe()}, packing "
              f"{self.packing}{setup.evals.describe() if setup.evals else ''}; "
              f"{c.total_steps} steps of {c.batch} x {c.seq_len} tokens; plan: {self.plan_description}; "
              f"output: {self.out}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ finish
    def _summary(self, engine: Engine, loop: "TrainingLoop", plan: Plan) -> dict[str, Any]:
        """summary.json's figures; ``plan`` as megatrain-plan plan --json gives it (its "plan" key)."""
        engine.synchronize()
        packed = loop.data.packed
        return metrics.summarize(loop.records, engine.num_parameters, loop.flops, loop.peak, engine.device, {
            "peak_source": loop.peak_source, "out": os.path.abspath(self.out), "metrics": loop.metrics_path,
            **run_dir.written(self.out, self.config.log_to),
            "checkpoint": f"{loop.ckpt_root} (step {loop.saved_at})" if loop.saved_at is not None else "none",
            "trace": loop.tracer.describe() if loop.tracer is not None else None,
            **loop.outcome(), "notes": self.notes, "plan": plan.to_dict(),
            "packing": {"mode": self.packing, **packed.to_dict(), "padding_fraction": packed.padding_fraction},
        }, history=metrics.read_metrics(loop.metrics_path))

    def _finish(self, summary: dict[str, Any], loop: "TrainingLoop") -> int:
        """The export, the plot, summary.json and the summary's lines (stdout, and stderr); returns the exit status."""
        c = self.config
        if c.export_on_finish and loop.exit_code == 0:
            summary["export"], failure = export.export_run(loop.ckpt_root, c.export_on_finish, c.export_dtype)
            if failure:
                print(f"megatrain-train: error: {failure}", file=sys.stderr)
                self.notes.append(failure)
                summary["exit_code"] = loop.exit_code = 1
        summary["plot"] = plot(metrics.read_metrics(loop.metrics_path), os.path.join(self.out, "training.png")) \
            if c.plot else "off (--no-plot)"
        metrics.write_summary(os.path.join(self.out, "summary.json"), summary)
        loop.sink.close(summary)  # --log-to: the summary too
        progress.print_summary("\n".join([metrics.format_summary(summary), *(f"note: {note}" for note in self.notes)]))
        return loop.exit_code


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainConfigError("device=cuda but torch sees no CUDA GPU; use --device auto or cpu")
    return torch.device(name)


def _compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on a GPU; fp32 on a CPU, whose bf16 matmuls are slow."""
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name] if name != "auto" else \
        torch.bfloat16 if device.type == "cuda" else torch.float32


def _optimizer(c: TrainConfig) -> OptimizerConfig:
    """A non-finite gradient skips its update (and says so) instead of turning the masters into NaN."""
    return OptimizerConfig(lr=c.lr, betas=(c.beta1, c.beta2), weight_decay=c.weight_decay,
                           max_grad_norm=c.max_grad_norm if c.max_grad_norm > 0 else None, no_decay=("norm", "bias"),
                           skip_nonfinite=True, state_dtype=c.optimizer_state)


def command() -> None:
    """The ``megatrain-train`` program: its own process keeps the heap its steps free ([Note: freed heap] in
    runtime/device/host_heap.py), runs ``main`` and exits with its status ([Note: a rank's exit])."""
    keep_freed_heap()
    exit_process(main())


if __name__ == "__main__":
    command()
