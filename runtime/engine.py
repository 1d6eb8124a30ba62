"""The public entry point: ``Engine`` trains a model whose weights and optimizer state live in host memory.

    engine = Engine(ModelConfig.from_hf("config.json"), optimizer=OptimizerConfig(lr=3e-4))
    loss = engine.step(input_ids, labels)      # one optimizer step over the whole batch
    loss = engine.step(input_ids, labels, position_ids=positions)   # packed rows: documents apart

``step`` returns the batch's mean loss as a 0-dim tensor on the compute device
without waiting for the GPU; call ``.item()`` when you want the number.
``state_dict`` / ``load_state_dict`` speak Hugging Face parameter names in float32.
``position_ids`` ([B, S], 0 where a document starts, +1 otherwise, as Hugging Face's packed-sequence
collators write them) keep packed documents apart: RoPE positions restart and attention stays within
each document (models/layers/attention.py, [Note: document attention]).
"""
from __future__ import annotations

import atexit
import os
import warnings
import weakref
from typing import Mapping, Sequence

import torch

from megatrain.plan.buffer_kinds import placement
from megatrain.plan.plan import Plan

from megatrain.runtime import state_io
from megatrain.runtime.config import ModelConfig, OptimizerConfig
from megatrain.runtime.device.event_log import EventLog
from megatrain.runtime.distributed.collectives import Collectives
from megatrain.runtime.engine_arguments import check_arguments, resumed_plan
from megatrain.runtime.errors import ClosedError
from megatrain.runtime.io.training_checkpoint import CheckpointHandle, engine_settings
from megatrain.runtime.model.templates import Block, Templates
from megatrain.runtime.pipeline.executor import Executor
from megatrain.runtime.optim.stochastic_rounding import STATE_DTYPES
from megatrain.runtime.spill.spill_io import make_io
from megatrain.runtime.state.host_store import HostStore
from megatrain.runtime.state.resident_state import ResidentState
from megatrain.runtime.step_inputs import StepInputs

# Engines still open at interpreter exit are closed first: a worker thread caught mid-update by the
# interpreter's shutdown would abort the process ("terminate called without an active exception").
_OPEN_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    for engine in list(_OPEN_ENGINES):
        engine.close()


class Engine:
    """A facade over engine_arguments.py, step_inputs.py, the executor and state_io.py."""
    routing = property(lambda self: self.executor.routing.last, doc="The last step's StepRouting (MoE) or None")
    lm_loss = property(lambda self: self.executor.routing.lm_loss, doc="The last step's or evaluate's "
                       "language-model loss (mean cross-entropy, no router's load-balancing term): [] fp32; None before")

    def __init__(self, model_config: ModelConfig, optimizer: OptimizerConfig | None = None, plan: Plan | None = None,
                 compute_dtype: torch.dtype = torch.bfloat16, device: str | torch.device | None = None, seed: int = 0,
                 *, _skip_init: bool = False) -> None:
        """``_skip_init``: from_pretrained and load_checkpoint overwrite every weight anyway."""
        self._closed = False  # close() releases whatever of the engine was built; then every method refuses
        try:
            args = check_arguments(model_config, optimizer, plan, compute_dtype, device, seed)
            self.config, self.optimizer, plan = model_config, args.optimizer, args.plan
            self.compute_dtype, self.topology, self.device, self.seed = compute_dtype, args.topology, args.device, seed
            self.event_log = EventLog()
            self.templates = Templates(model_config, self.optimizer.decays)
            self.collectives = (None if self.topology is None else Collectives(
                self.topology, self.templates.blocks, self.device, plan.device_grad_buffers))
            store_blocks = self.templates.blocks if self.collectives is None else self.collectives.shards.blocks
            self.store = _host_store(plan, store_blocks, compute_dtype, self.optimizer, self.device)
            # Whole-state reads and writes (state dicts, Hugging Face files, checkpoints) first settle: see synchronize.
            self.state, self.state_io = state_io.open_state(self.templates, self.store, self.synchronize,
                                                            self.collectives)
            if not _skip_init:
                self.state.initialize(seed)
            self.checkpoint_extra: dict | None = None  # the caller's ``extra`` of the checkpoint this engine resumed
            self.skipped_steps: list[int] = []  # steps whose update was skipped for a non-finite gradient
            self.inputs = StepInputs(model_config, args, compute_dtype)
            self.executor = Executor(self.templates, self.store, plan, compute_dtype, self.device,
                                     self.optimizer.max_grad_norm, self.event_log, self.collectives)
        except BaseException:  # a refusal after some parts were built (I/O threads, pinned memory) leaves none behind
            self.close()
            raise
        _OPEN_ENGINES.add(self)

    # ------------------------------------------------------------------ training
    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, lr: float | None = None,
             position_ids: torch.Tensor | None = None, padding: torch.Tensor | None = None) -> torch.Tensor:
        """One AdamW step over the whole batch. input_ids, labels: [B, S] integer (labels -100 = ignored).

        ``position_ids``: [B, S] integer, packed documents (each row runs of 0, 1, 2, ...; a document starts
        where its position is 0): RoPE positions and attention restart at each document. None: one sequence
        per row. Label the first token of each document -100 to keep the token before it (the previous
        document's end) from predicting it. ``padding``: [B, S] bool, True at filler positions (labelled -100
        too): a mixture of experts' token counts (``routing``) leave them out. Returns the mean loss over all
        predicted tokens (+ the weighted load-balancing loss of a model with one, ``routing``, as transformers'
        ``outputs.loss``; the cross-entropy alone: ``lm_loss``) as a 0-dim fp32 tensor on the device."""
        self._check_open()
        hyper = self.inputs.hyper(lr)
        batch = self.inputs.step_batch(input_ids, labels, position_ids, padding)
        self._report_skipped()
        return self.executor.train_step(batch, hyper)

    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The mean loss over ``labels``' predicted tokens with the current weights, as ``step`` computes it
        (inputs as ``step``'s), without training: no gradient, update, step count, optimizer or random state
        changed. Streams the blocks as a step's forward does, never the full logits; a 0-dim fp32 device tensor
        (no sync), the same bits as ``step``'s loss for this batch before its update. Under data parallelism
        every rank passes the same whole batch (not its share, as for ``step``) and gets its loss."""
        self._check_open()
        batch = self.inputs.evaluation_batch(input_ids, labels, position_ids)
        self._report_skipped()
        return self.executor.evaluate(batch)

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The last step's global gradient norm (before clipping), a device scalar."""
        self._check_open()
        return self.executor.grad_norm

    @property
    def correct_tokens(self) -> torch.Tensor:
        """Labelled tokens of the last step (this rank's) or evaluate whose argmax is their label: [] int64."""
        self._check_open()
        return self.executor.correct

    def time_next_step(self) -> None:
        """Time the next ``step()`` for ``last_step_breakdown`` (only a step asked for records timing events)."""
        self._check_open()
        self.executor.timer.arm()

    @property
    def last_step_breakdown(self) -> dict[str, float] | None:
        """Seconds of the last timed step (``time_next_step()`` first, else None): ``step_s``, ``compute_s``, what
        was exposed and what each resource was busy, ``forward_s``, the roofline (step_timer.py; the README's
        ``engine.last_step_breakdown`` paragraph). On CUDA, reading it waits for that step once."""
        self._check_open()
        return self.executor.timer.breakdown(self.executor.optim.busy_seconds)

    @property
    def plan(self) -> Plan:
        """The plan this engine runs: the one given, else ``default_plan`` with the first step's micro-batch."""
        return self.inputs.plan

    @property
    def step_count(self) -> int:
        self._check_open()
        return self.executor.step_no

    @property
    def num_parameters(self) -> int:
        return sum(e.numel for b in self.templates.blocks for e in b.layout.entries)

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Evaluation forward: [B, S] ids -> [B, S, vocab] fp32 logits (materialised; keep inputs small).
        ``position_ids``: packed documents, as in ``step``."""
        self._check_open()
        return self.executor.forward_logits(*self.inputs.logits_inputs(input_ids, position_ids))

    # ------------------------------------------------------------------ weights
    def synchronize(self) -> None:
        """Wait until every queued update is in the host store (and spill files) and the device is idle."""
        self._check_open()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.executor.optim.wait_all(self.executor.step_no)
        self.store.flush()
        self._report_skipped()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Float32 copies of the master weights under Hugging Face names (tied lm_head included, as HF does)."""
        self._check_open()
        return self.state.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy weights (any float dtype) into the fp32 masters. Keys and shapes must match exactly."""
        self._check_open()
        self.state.load_state_dict(state_dict)

    def optimizer_state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW state per parameter under Hugging Face names: exp_avg, exp_avg_sq, step (as torch.optim keeps it)."""
        self._check_open()
        return self.state.optimizer_state_dict()

    @property
    def hf_config(self) -> dict | None:
        """The config.json this engine was loaded from (from_pretrained, or a checkpoint of such), kept for export."""
        return self.state.hf_config

    @hf_config.setter
    def hf_config(self, value: dict | None) -> None:
        self.state.hf_config = value

    # ------------------------------------------------------------------ Hugging Face and checkpoints
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, optimizer: OptimizerConfig | None = None, plan: Plan | None = None,
                        compute_dtype: torch.dtype = torch.bfloat16,
                        device: str | torch.device | None = None) -> "Engine":
        """A Hugging Face model directory (config.json + *.safetensors, optional index), streamed tensor by tensor
        into the fp32 masters: peak extra RAM is one tensor (see runtime/io/hf_io.py)."""
        pretrained = state_io.find_pretrained(path)
        engine = cls(ModelConfig.from_hf(pretrained.hf_config), optimizer, plan, compute_dtype, device, _skip_init=True)
        try:
            state_io.load_pretrained(engine.state, pretrained.files)
        except BaseException:
            engine.close()
            raise
        engine.hf_config = pretrained.hf_config
        return engine

    def save_pretrained(self, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                        max_shard_bytes: int = 5 * 10**9, allow_nonfinite: bool = False) -> None:
        """A directory transformers.AutoModelForCausalLM.from_pretrained loads: config.json, safetensors shards of at
        most ``max_shard_bytes`` (+ index); NaN or inf weights raise NonFiniteError unless ``allow_nonfinite``."""
        self._check_open()
        self.state_io.save_pretrained(path, dtype, max_shard_bytes, allow_nonfinite)

    def save_checkpoint(self, directory: str | os.PathLike, extra: Mapping[str, object] | None = None,
                        keep: int = 3, blocking: bool = False) -> "CheckpointHandle":
        """Save the full training state to ``directory/step-<N>`` and point ``directory/latest`` at it.

        ``extra``: a JSON-serialisable dict (RNG state, data position, schedule), returned by
        ``load_checkpoint`` as ``engine.checkpoint_extra``. Not blocking: the state is snapshotted (the only
        stall) and written by a background thread; ``handle.wait()`` or ``wait_for_checkpoint()`` waits.
        The newest ``keep`` checkpoints stay. See runtime/io/training_checkpoint.py for the commit protocol.
        """
        self._check_open()
        plan = self.inputs.recorded_plan  # None: the default plan, its micro-batch still open
        settings = engine_settings(self.config, self.optimizer, plan, self.compute_dtype, self.seed)
        return self.state_io.save_checkpoint(self.step_count, settings, directory, extra, keep, blocking)

    def wait_for_checkpoint(self) -> str | None:
        """Wait for the checkpoint being written (raising its error, if any); its directory, or None."""
        self._check_open()
        return self.state_io.wait()

    @classmethod
    def load_checkpoint(cls, directory: str | os.PathLike, device: str | torch.device | None = None,
                        plan: Plan | None = None) -> "Engine":
        """Resume: the checkpoint ``directory/latest`` names (or a ``step-<N>`` directory itself), verified against
        its manifest's checksums. ``plan`` replaces the saved plan (e.g. on another machine)."""
        checkpoint = state_io.find_checkpoint(directory)
        recorded = resumed_plan(checkpoint.arguments["plan"], device)  # without its CPU choices off a CPU
        args = {**checkpoint.arguments, "plan": recorded if plan is None else plan}
        engine = cls(**args, device=device, _skip_init=True)
        try:
            restored = engine.state_io.restore(checkpoint.path, checkpoint.manifest)
        except BaseException:
            engine.close()
            raise
        engine.executor.restore(restored.step)  # the executor continues from there, every update applied
        engine.checkpoint_extra = restored.extra
        return engine

    def close(self) -> None:
        """Stop the optimizer worker, unpin host memory; then every method raises ClosedError (again: no-op)."""
        if getattr(self, "_closed", True):
            return  # closed already
        self._closed = True
        files = getattr(self, "state_io", None)
        if files is not None:
            files.close()  # a background checkpoint write finishes before the engine goes
        executor = getattr(self, "executor", None)
        if executor is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # no copy may still use host memory about to be unpinned
            executor.close()
        store = getattr(self, "store", None)
        if store is not None:
            store.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ internals
    def _report_skipped(self) -> None:
        """Warn about steps whose update the AdamW worker skipped (OptimizerConfig(skip_nonfinite=True))."""
        steps = [s for s in self.executor.optim.take_skipped() if s not in self.skipped_steps]
        if steps:
            self.skipped_steps.extend(steps)
            warnings.warn(f"step {', '.join(map(str, steps))}: the gradient is not finite (NaN or inf), so the update "
                          "was skipped (skip_nonfinite=True); check the data, the learning rate and the loss",
                          RuntimeWarning, stacklevel=3)

    def _check_open(self) -> None:
        if getattr(self, "_closed", True):
            raise ClosedError("this Engine is closed (close() or the end of its with-block); "
                              "build a new one, or Engine.load_checkpoint(...) to continue a run")


def _host_store(plan: Plan, blocks: Sequence[Block], compute_dtype: torch.dtype, optimizer: OptimizerConfig,
                device: torch.device) -> HostStore:
    """The model state's store for ``plan``: RAM arenas, the spill files of what it spills (with their I/O backend),
    the device state of its resident blocks."""
    spilled = placement(plan, len(blocks))  # per kind, the blocks in spill files
    io = make_io(plan.io_backend, plan.io_threads, plan.io_direct, plan.direct_reads) if spilled else None
    try:
        return HostStore(blocks, compute_dtype, full_grads=plan.optimizer_mode == "deferred", io=io,
                         grad_slabs=plan.host_grad_slabs, pin=device.type == "cuda", placement=spilled,
                         spill_dir=plan.spill_dir, staging=plan.spill_staging, chunk_bytes=plan.spill_chunk_bytes,
                         state_dtype=STATE_DTYPES[optimizer.state_dtype], weights_cast=plan.weights_cast,
                         resident=ResidentState.of(plan.resident_blocks, blocks, device))
    except BaseException:
        if io is not None:  # a store refused (or out of memory) leaves no I/O threads behind in the caller's process
            io.close()
        raise
