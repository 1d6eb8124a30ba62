"""The public entry point: ``Engine`` trains a model whose weights and optimizer state live in host memory.

    engine = Engine(ModelConfig.from_hf("config.json"), optimizer=OptimizerConfig(lr=3e-4))
    loss = engine.step(input_ids, labels)      # one optimizer step over the whole batch
    loss = engine.step(input_ids, labels, position_ids=positions)   # packed rows: documents apart

``step`` returns the batch's mean loss as a 0-dim tensor on the compute device
without waiting for the GPU; call ``.item()`` when you want the number.
``state_dict`` / ``load_state_dict`` speak Hugging Face parameter names in float32.
``position_ids`` ([B, S], 0 where a document starts, +1 otherwise, as Hugging Face's packed-sequence
collators write them) keep packed documents apart: RoPE positions restart and attention stays within
each document (runtime/model/attention.py, [Note: document attention]).
"""
from __future__ import annotations

import atexit
import math
import os
import warnings
import weakref
from typing import TYPE_CHECKING, Mapping

import torch

from megatrain.planner.buffer_kinds import placement
from megatrain.planner.plan import Plan, PlanError, default_plan, shape_digest

from megatrain.models.layers.attention import Documents
from megatrain.runtime.pipeline.head_loss import IGNORE_INDEX, shift_labels
from megatrain.runtime.config import ModelConfig, OptimizerConfig
from megatrain.runtime.distributed.collectives import Collectives
from megatrain.runtime.pipeline.cpu_adamw import AdamHyper
from megatrain.runtime.errors import ClosedError, ConfigError, InputError
from megatrain.runtime.device.event_log import EventLog
from megatrain.runtime.pipeline.executor import Batch, Executor
from megatrain.runtime.state.host_store import HostStore
from megatrain.runtime.state.model_state import ModelState
from megatrain.runtime.paths import user_path
from megatrain.runtime.distributed.process_group import join as join_ranks, rank_device
from megatrain.runtime.distributed.sharded_state import ShardedModelState
from megatrain.runtime.spill.spill_io import make_io
from megatrain.runtime.model.templates import Templates

if TYPE_CHECKING:
    from megatrain.runtime.io.training_checkpoint import CheckpointHandle, CheckpointWriter

COMPUTE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}

# Engines still open at interpreter exit are closed first: a worker thread caught mid-update by the
# interpreter's shutdown would abort the process ("terminate called without an active exception").
_OPEN_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    for engine in list(_OPEN_ENGINES):
        engine.close()


class Engine:
    def __init__(
        self,
        model_config: ModelConfig,
        optimizer: OptimizerConfig | None = None,
        plan: Plan | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device | None = None,
        seed: int = 0,
        *,
        _skip_init: bool = False,  # from_pretrained / load_checkpoint overwrite every weight anyway
    ) -> None:
        self._closed = False  # close() releases whatever of the engine was built; then every method refuses
        if not isinstance(model_config, ModelConfig):
            raise ConfigError(
                f"model_config is a {type(model_config).__name__}; build one with ModelConfig(...) or ModelConfig.from_hf(path)"
            )
        self.config = model_config
        self.optimizer = optimizer if optimizer is not None else OptimizerConfig()
        if not isinstance(self.optimizer, OptimizerConfig):
            raise ConfigError(f"optimizer is a {type(self.optimizer).__name__}; pass OptimizerConfig(...)")
        self.plan = plan if plan is not None else default_plan(self.optimizer.clipping)
        if not isinstance(self.plan, Plan):
            raise PlanError(f"plan is a {type(self.plan).__name__}; pass a Plan (e.g. Plan.load('plan.json')) or None")
        if self.plan.optimizer_mode == "eager" and self.optimizer.clipping:
            raise PlanError(
                f"optimizer_mode='eager' cannot clip gradients (max_grad_norm={self.optimizer.max_grad_norm}): "
                "use optimizer_mode='deferred', or OptimizerConfig(max_grad_norm=None)"
            )
        if not isinstance(compute_dtype, torch.dtype) or compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(
                f"compute_dtype={compute_dtype!r} is not supported; use torch.bfloat16 (fast) or torch.float32 (exact)"
            )
        self.compute_dtype = compute_dtype
        if self.plan.workload is not None:  # a plan's memory bounds hold only for the model and dtype it was made for
            self.plan.workload.check_model(shape_digest(model_config.to_dict()),
                                           str(compute_dtype).removeprefix("torch."))
        # Several ranks (a process group, or torchrun's environment): this rank's shards ([Note: collectives]).
        self.topology = join_ranks()
        self.device = _pick_device(rank_device(self.topology, device))
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**40:
            raise ConfigError(f"seed={seed!r} must be an integer in [0, 2**40)")
        self.seed = seed
        self.event_log = EventLog()
        self.templates = Templates(model_config, self.optimizer.decays)
        self.collectives = (None if self.topology is None else
                            Collectives(self.topology, self.templates.blocks, self.device, self.plan.device_grad_buffers))
        store_blocks = self.templates.blocks if self.collectives is None else self.collectives.shards.blocks
        spilled = placement(self.plan, len(store_blocks))  # per kind, the blocks in spill files
        spilling = bool(spilled)
        self.store = HostStore(
            store_blocks, compute_dtype, full_grads=self.plan.optimizer_mode == "deferred",
            grad_slabs=self.plan.host_grad_slabs, pin=self.device.type == "cuda",
            placement=spilled, spill_dir=self.plan.spill_dir,
            io=make_io(self.plan.io_backend, self.plan.io_threads, self.plan.io_direct) if spilling else None,
            staging=self.plan.spill_staging, chunk_bytes=self.plan.spill_chunk_bytes,
        )
        # Whole-state reads and writes (state dicts, Hugging Face files, checkpoints) first settle: see synchronize.
        self.state = (ModelState(self.templates, self.store, settle=self.synchronize) if self.collectives is None else
                      ShardedModelState(self.templates, self.store, self.synchronize, self.collectives))
        if not _skip_init:
            self.state.initialize(seed)
        self.checkpoint_extra: dict | None = None  # the caller's ``extra`` of the checkpoint this engine resumed
        self.skipped_steps: list[int] = []  # steps whose update was skipped for a non-finite gradient
        self._checkpoint_writer: "CheckpointWriter | None" = None  # created on the first save
        self.executor = Executor(self.templates, self.store, self.plan, compute_dtype, self.device,
                                 self.optimizer.max_grad_norm, self.event_log, self.collectives)
        _OPEN_ENGINES.add(self)

    # ------------------------------------------------------------------ training
    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, lr: float | None = None,
             position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One AdamW step over the whole batch. input_ids, labels: [B, S] integer (labels -100 = ignored).

        ``position_ids``: [B, S] integer, packed documents (each row runs of 0, 1, 2, ...; a document starts
        where its position is 0): RoPE positions and attention restart at each document. None: one sequence
        per row. Label the first token of each document -100 to keep the token before it (the previous
        document's end) from predicting it. Returns the mean loss over all predicted tokens as a 0-dim fp32
        tensor on the device.
        """
        self._check_open()
        lr = self.optimizer.lr if lr is None else lr
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr < 0:
            raise InputError(f"lr={lr!r} must be a finite number >= 0 (e.g. 3e-4)")
        batch = self._batch(input_ids, labels, position_ids)
        if self.plan.workload is not None:  # host-side shape ints: no device sync
            self.plan.workload.check_batch(*input_ids.shape)
        self._report_skipped()
        b1, b2 = self.optimizer.betas
        hyper = AdamHyper(float(lr), b1, b2, self.optimizer.eps, self.optimizer.weight_decay,
                          self.optimizer.skip_nonfinite)
        return self.executor.train_step(batch, hyper)

    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The mean loss over ``labels``' predicted tokens with the current weights, as ``step`` computes it
        (inputs as for ``step``), without training: no gradient, no update, no change to the step count,
        the optimizer state or the random state. Streams the blocks through the device as a step's forward
        does and never materialises the full logits. Returns a 0-dim fp32 tensor on the device (no sync).

        The value is the same bits as the loss ``step`` returns for this batch before its update. Under data
        parallelism every rank passes the same whole batch (not its share, as for ``step``) and gets its loss.
        """
        self._check_open()
        batch = self._batch(input_ids, labels, position_ids)
        if self.plan.workload is not None:  # a rank's plan is for its share; evaluation takes the whole batch
            ranks = 1 if self.topology is None else self.topology.world_size
            self.plan.workload.check_batch(-(-input_ids.shape[0] // ranks), input_ids.shape[1])
        self._report_skipped()
        return self.executor.evaluate(batch)

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The last step's global gradient norm (before clipping), a device scalar."""
        self._check_open()
        return self.executor.grad_norm

    @property
    def correct_tokens(self) -> torch.Tensor:
        """Predicted tokens of the last ``step`` (this rank's rows) or ``evaluate`` whose argmax over the
        vocabulary is their label: a 0-dim int64 device tensor (no sync), counted chunk by chunk in the head."""
        self._check_open()
        return self.executor.correct

    def time_next_step(self) -> None:
        """Time the next ``step()`` for ``last_step_breakdown`` (only a step asked for records timing events)."""
        self._check_open()
        self.executor.timer.arm()

    @property
    def last_step_breakdown(self) -> dict[str, float] | None:
        """Seconds of the last step: ``step_s``, ``compute_s``, and the exposed ``h2d_exposed_s``,
        ``d2h_exposed_s``, ``ckpt_traffic_s`` (host checkpoints) and ``adam_exposed_s``; how long each
        resource was busy, ``h2d_busy_s``, ``d2h_busy_s`` and ``adam_busy_s`` (the latest step whose updates
        all finished: absent until one has); ``roofline_s`` = max(compute, H2D, D2H, AdamW busy) and
        ``roofline_ratio`` = step / roofline (1.0: fully overlapped). On CUDA, reading it waits for that step
        to finish on the GPU (once); on a CPU the copies' host time is what they cost.
        None when that step was not timed: ask with ``time_next_step()`` before it."""
        self._check_open()
        return self.executor.timer.breakdown(self.executor.adam.busy_seconds)

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
        ids = self._check_ids(input_ids, "input_ids")
        self._check_seq(ids.shape[1])
        positions = self._check_positions(position_ids, ids.shape)
        if positions is None:
            return self.executor.forward_logits(self._to_device(ids))
        return self.executor.forward_logits(self._to_device(ids), self._to_device(positions),
                                            Documents.from_position_ids(positions))

    # ------------------------------------------------------------------ weights
    def synchronize(self) -> None:
        """Wait until every queued optimizer update has been applied to the host store (and spill files),
        and the device has finished what was queued (its copies may still read the host store)."""
        self._check_open()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.executor.adam.wait_all(self.executor.step_no)
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
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        optimizer: OptimizerConfig | None = None,
        plan: Plan | None = None,
        compute_dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device | None = None,
    ) -> "Engine":
        """A Hugging Face model directory (config.json + *.safetensors, optional index), streamed tensor by tensor
        into the fp32 masters: peak extra RAM is one tensor (see runtime/io/hf_io.py)."""
        from megatrain.runtime.io import hf_io

        path = user_path(path, "path")
        if not os.path.isdir(path):
            raise InputError(f"{path} is not a directory; pass a Hugging Face model directory (config.json + *.safetensors)")
        hf_config = hf_io.read_config(path)
        files = hf_io.find_shards(path)
        engine = cls(ModelConfig.from_hf(hf_config), optimizer, plan, compute_dtype, device, _skip_init=True)
        try:
            hf_io.load_weights(engine.state, files)
        except BaseException:
            engine.close()
            raise
        engine.hf_config = hf_config
        return engine

    def save_pretrained(self, path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                        max_shard_bytes: int = 5 * 10**9) -> None:
        """Write a directory transformers.AutoModelForCausalLM.from_pretrained loads: config.json and safetensors
        shards of at most ``max_shard_bytes`` (plus the index when there are several)."""
        self._check_open()
        from megatrain.runtime.io import hf_io

        if isinstance(self.state, ShardedModelState):  # rank 0 writes, gathering block by block; every rank calls it
            self.state.on_first_rank(lambda: hf_io.save_pretrained(self.state, path, dtype, max_shard_bytes))
        else:
            hf_io.save_pretrained(self.state, path, dtype, max_shard_bytes)

    def save_checkpoint(self, directory: str | os.PathLike, extra: Mapping[str, object] | None = None,
                        keep: int = 3, blocking: bool = False) -> "CheckpointHandle":
        """Save the full training state to ``directory/step-<N>`` and point ``directory/latest`` at it.

        ``extra``: a JSON-serialisable dict (RNG state, data position, schedule), returned by
        ``load_checkpoint`` as ``engine.checkpoint_extra``. Not blocking: the state is snapshotted (the only
        stall) and written by a background thread; ``handle.wait()`` or ``wait_for_checkpoint()`` waits.
        The newest ``keep`` checkpoints stay. See runtime/io/training_checkpoint.py for the commit protocol.
        """
        self._check_open()
        from megatrain.runtime.io import training_checkpoint

        if self._checkpoint_writer is None:
            self._checkpoint_writer = training_checkpoint.CheckpointWriter()
        settings = training_checkpoint.engine_settings(self.config, self.optimizer, self.plan, self.compute_dtype,
                                                       self.seed)
        if isinstance(self.state, ShardedModelState):  # every rank writes its shards; blocking ([Note: sharded checkpoints])
            from megatrain.runtime.io import sharded_checkpoint

            path = sharded_checkpoint.save(self.state, self._checkpoint_writer, self.step_count, settings, directory,
                                           extra, keep)
            return training_checkpoint.CheckpointHandle(path)  # committed: wait() returns it
        return self._checkpoint_writer.save(self.state, self.step_count, settings, directory, extra, keep, blocking)

    def wait_for_checkpoint(self) -> str | None:
        """Wait for the checkpoint being written (raising its error, if any); its directory, or None."""
        self._check_open()
        return None if self._checkpoint_writer is None else self._checkpoint_writer.wait()

    @classmethod
    def load_checkpoint(cls, directory: str | os.PathLike, device: str | torch.device | None = None,
                        plan: Plan | None = None) -> "Engine":
        """Resume: the checkpoint ``directory/latest`` names (or a ``step-<N>`` directory itself), verified against
        its manifest's checksums. ``plan`` replaces the saved plan (e.g. on another machine)."""
        from megatrain.runtime.io import training_checkpoint

        path = training_checkpoint.resolve(directory)
        manifest = training_checkpoint.read_manifest(path)
        args = training_checkpoint.engine_arguments(manifest)
        if plan is not None:
            args["plan"] = plan
        engine = cls(**args, device=device, _skip_init=True)
        try:
            if isinstance(engine.state, ShardedModelState):  # every rank keeps its shards of any world size's checkpoint
                from megatrain.runtime.io import sharded_checkpoint

                restored = sharded_checkpoint.restore(engine.state, path, manifest)
            else:
                restored = training_checkpoint.restore(engine.state, path, manifest)
        except BaseException:
            engine.close()
            raise
        engine.executor.step_no = restored.step  # the executor continues from there, every update applied
        engine.executor.adam.restore(restored.step)
        engine.checkpoint_extra = restored.extra
        return engine

    def close(self) -> None:
        """Stop the optimizer worker and unpin host memory. Afterwards every method raises ClosedError at once;
        closing again does nothing."""
        if getattr(self, "_closed", True):
            return  # closed already
        self._closed = True
        writer = getattr(self, "_checkpoint_writer", None)
        if writer is not None:
            writer.close()  # a background checkpoint write finishes before the engine goes
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
        steps = [s for s in self.executor.adam.take_skipped() if s not in self.skipped_steps]
        if steps:
            self.skipped_steps.extend(steps)
            warnings.warn(f"step {', '.join(map(str, steps))}: the gradient is not finite (NaN or inf), so the update "
                          "was skipped (skip_nonfinite=True); check the data, the learning rate and the loss",
                          RuntimeWarning, stacklevel=3)

    def _check_open(self) -> None:
        if getattr(self, "_closed", True):
            raise ClosedError("this Engine is closed (close() or the end of its with-block); "
                              "build a new one, or Engine.load_checkpoint(...) to continue a run")

    def _check_ids(self, t: object, name: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor of token ids, got {type(t).__name__}")
        if t.dim() != 2:
            raise InputError(f"{name} has shape {tuple(t.shape)}; expected [batch, seq_len] (use .unsqueeze(0) for one sequence)")
        if t.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise InputError(f"{name} has dtype {t.dtype}; expected an integer tensor (torch.long)")
        if t.numel() == 0:
            raise InputError(f"{name} is empty (shape {tuple(t.shape)}); pass at least one token")
        # Validated on the host: ids outside the vocabulary would fault the device later, far from the cause.
        host = t.detach().to("cpu", torch.int64)
        if name == "input_ids":
            lo, hi = int(host.min()), int(host.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise InputError(
                    f"input_ids has ids in [{lo}, {hi}] but vocab_size={self.config.vocab_size}; "
                    "check the tokenizer matches the model"
                )
        return host

    def _check_seq(self, seq: int) -> None:
        window = self.config.sliding_window
        if window is not None and seq > window:
            raise InputError(
                f"seq_len={seq} exceeds sliding_window={window}, which megatrain does not implement; "
                f"use sequences of at most {window} tokens"
            )

    def _check_positions(self, position_ids: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
        """Packed rows' position ids on the host, checked; None when every row is one sequence from 0 (then the
        step is exactly the one without position ids)."""
        if position_ids is None:
            return None
        if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (torch.int64, torch.int32,
                                                                                    torch.int16, torch.uint8):
            raise InputError(f"position_ids must be an integer torch.Tensor [batch, seq_len], got "
                             f"{getattr(position_ids, 'dtype', type(position_ids).__name__)}")
        if position_ids.shape != shape:
            raise InputError(f"position_ids has shape {tuple(position_ids.shape)} but input_ids has {tuple(shape)}; "
                             "give one position per token")
        pos = position_ids.detach().to("cpu", torch.int64)
        step_ok = (pos[:, 1:] == 0) | (pos[:, 1:] == pos[:, :-1] + 1)
        if bool((pos[:, 0] != 0).any()) or not bool(step_ok.all()):
            bad = torch.cat([pos[:, :1] != 0, ~step_ok], dim=1).nonzero()[0].tolist()
            raise InputError(f"position_ids row {bad[0]} has {int(pos[bad[0], bad[1]])} at token {bad[1]}; each row "
                             "must be runs of 0, 1, 2, ... (0 where a document starts, the previous + 1 otherwise)")
        if not bool((pos[:, 1:] == 0).any()):
            return None
        return pos

    def _batch(self, input_ids: torch.Tensor, labels: torch.Tensor,
               position_ids: torch.Tensor | None = None) -> Batch:
        ids = self._check_ids(input_ids, "input_ids")
        lab = self._check_ids(labels, "labels")
        if lab.shape != ids.shape:
            raise InputError(
                f"labels has shape {tuple(lab.shape)} but input_ids has {tuple(ids.shape)}; "
                "they must match (labels are shifted inside, as in Hugging Face)"
            )
        bad = (lab != IGNORE_INDEX) & ((lab < 0) | (lab >= self.config.vocab_size))
        if bool(bad.any()):
            value = int(lab[bad][0])
            raise InputError(
                f"labels holds {value}, outside [0, {self.config.vocab_size}) and not -100 (ignored); "
                "check the tokenizer or mask with -100"
            )
        self._check_seq(ids.shape[1])
        shifted = shift_labels(lab)
        n_tokens = int((shifted != IGNORE_INDEX).sum())
        if n_tokens == 0:
            raise InputError("labels leave no token to predict (all -100 after the shift); check the masking")
        positions = self._check_positions(position_ids, ids.shape)
        mbs = self.plan.micro_batch_size
        micro = [slice(s, min(s + mbs, ids.shape[0])) for s in range(0, ids.shape[0], mbs)]
        return Batch(
            input_ids=self._to_device(ids),
            labels=self._to_device(shifted),
            n_tokens=self._to_device(torch.tensor(n_tokens)),
            micro=micro,
            position_ids=None if positions is None else self._to_device(positions),
            documents=None if positions is None else [Documents.from_position_ids(positions[rows]) for rows in micro],
        )

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host tensor -> device without a host sync: a copy from pageable memory would wait for the
        stream's queued work (the previous step), so it goes through pinned memory, which torch's
        pinned allocator keeps until the copy is done."""
        if self.device.type != "cuda":
            return t
        # Contiguous first: a strided pinned tensor would be copied through pageable memory.
        return t.contiguous().pin_memory().to(self.device, non_blocking=True)


def _pick_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"device={device!r} is not a device; use 'cuda', 'cuda:0', 'cpu' or None (auto)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device='cuda' but torch sees no CUDA GPU; use device=None (auto) or 'cpu'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ConfigError(f"device={device!r} is not supported; use 'cuda' or 'cpu'")
    return dev
