"""What ``step``, ``evaluate`` and ``logits`` are given, checked where they are and moved to the device.

Token ids outside the vocabulary, labels that predict nothing, malformed position ids or a batch the plan
was not made for are refused here, with one line saying how to fix it, before anything reaches the device
(a bad id would fault it later, far from the cause). Tensors already on the GPU are checked there: only the
figures a check needs (a minimum, a count) reach the host, never the tensor. A checked batch becomes the
executor's ``Batch``: shifted labels, the count of predicted tokens, the plan's micro-batches and each one's documents.

Without a plan given, the default plan's micro-batch is open until the first training step, which sets it to
that step's batch (this rank's share): a batch that fits is never split into micro-batches a plan did not ask
for (each split runs every block's matmuls once more per micro-batch). Until then evaluation takes its whole
batch as one micro-batch. The same first step sets the layers it keeps ([Note: kept layers]): the planner's
``default_kept_layers`` for that batch and the memory the device has free then.
"""
from __future__ import annotations

import math

import psutil
import torch

from megatrain.models.layers.attention import Documents
from megatrain.plan.plan import Plan
from megatrain.planner import first_batch

from megatrain.runtime import batch_limits, config_ranges
from megatrain.runtime.config import ModelConfig
from megatrain.runtime.engine_arguments import Arguments
from megatrain.runtime.errors import InputError
from megatrain.runtime.optim.adamw_kernel import AdamHyper
from megatrain.runtime.pipeline.executor import Batch
from megatrain.runtime.model.head_loss import IGNORE_INDEX, shift_labels

ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


class StepInputs:
    def __init__(self, config: ModelConfig, args: Arguments, compute_dtype: torch.dtype) -> None:
        self.config, self.optimizer, self.plan, self.device = config, args.optimizer, args.plan, args.device
        self.compute_dtype = compute_dtype
        self.ranks = 1 if args.topology is None else args.topology.world_size
        self.micro_batch_open = not args.plan_given  # the default plan's micro-batch: set by the first step
        self.fitting_shapes: set[tuple[int, ...]] = set()  # batch shapes whose activations fit (batch_limits)

    @property
    def recorded_plan(self) -> Plan | None:
        """The plan a checkpoint records: None while the default plan's micro-batch is still open (a resumed
        engine then opens it again, at its first step)."""
        return None if self.micro_batch_open else self.plan

    def hyper(self, lr: float | None) -> AdamHyper:
        """The AdamW hyperparameters of one step: ``lr`` (None: the optimizer's) checked."""
        lr = self.optimizer.lr if lr is None else lr
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or not \
                0 <= lr <= config_ranges.LR_MAX:
            raise InputError(f"lr={lr!r} must be a finite number in [0, {config_ranges.LR_MAX:g}] (e.g. 3e-4; no "
                             f"real run uses more)")
        product = config_ranges.decay_product(lr, self.optimizer.weight_decay)
        if product:
            raise InputError(product)
        b1, b2 = self.optimizer.betas
        return AdamHyper(float(lr), b1, b2, self.optimizer.eps, self.optimizer.weight_decay,
                         self.optimizer.skip_nonfinite)

    def step_batch(self, input_ids: torch.Tensor, labels: torch.Tensor,
                   position_ids: torch.Tensor | None, padding: torch.Tensor | None = None) -> Batch:
        """A training step's batch: this rank's share, of the shape the plan was made for, whose activations fit."""
        if self.plan.workload is not None and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
            self.plan.workload.check_batch(*input_ids.shape)  # host-side shape ints: no device sync
        self._check_fits(input_ids)
        batch = self._batch(input_ids, labels, position_ids)
        if padding is not None:
            if tuple(padding.shape) != tuple(input_ids.shape) or padding.dtype != torch.bool:
                raise InputError(f"padding has shape {tuple(padding.shape)} and dtype {padding.dtype}; it must be "
                                 f"bool of input_ids' shape {tuple(input_ids.shape)} (True at padding)")
            batch.padding = self._to_device(padding)
        if self.micro_batch_open:
            plan = self.plan.replace(micro_batch_size=input_ids.shape[0])
            self.plan = plan.replace(kept_layers=self._default_kept(plan, *input_ids.shape))
            self.micro_batch_open = False
        batch.kept = frozenset(self.plan.kept_layers)  # [Note: kept layers]
        return batch

    def _check_fits(self, input_ids: torch.Tensor) -> None:
        """A batch shape not seen before: its activations must fit the device (runtime/batch_limits.py)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or 0 in input_ids.shape or \
                tuple(input_ids.shape) in self.fitting_shapes:
            return  # not a batch (refused by _batch), or checked already
        batch_limits.check(self.config, self.compute_dtype, self.optimizer.clipping, self.plan, self.micro_batch_open,
                           *input_ids.shape, self.device)
        self.fitting_shapes.add(tuple(input_ids.shape))

    def _default_kept(self, plan: Plan, batch: int, seq: int) -> tuple[int, ...]:
        """The layers the default plan keeps for batches of [batch, seq]: the planner's choice for the memory the
        device has free now (the engine's buffers allocated)."""
        free = (torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda"
                else psutil.virtual_memory().available)
        return first_batch.kept_layers_for(self.config, str(self.compute_dtype).removeprefix("torch."),
                                           self.optimizer.clipping, plan, batch, seq, free)

    def evaluation_batch(self, input_ids: torch.Tensor, labels: torch.Tensor,
                         position_ids: torch.Tensor | None) -> Batch:
        """An evaluation's batch: the whole batch on every rank."""
        batch = self._batch(input_ids, labels, position_ids)
        if self.plan.workload is not None:  # a rank's plan is for its share; evaluation takes the whole batch
            self.plan.workload.check_batch(-(-input_ids.shape[0] // self.ranks), input_ids.shape[1])
        return batch

    def logits_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None, Documents | None]:
        """``logits``' ids [B, S] on the device, and with packed rows their positions and documents."""
        ids = self._ids(input_ids, "input_ids")
        positions = self._positions(position_ids, ids.shape)
        if positions is None:
            return self._to_device(ids), None, None
        return self._to_device(ids), self._to_device(positions), Documents.from_position_ids(positions)

    def _ids(self, t: object, name: str) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor of token ids, got {type(t).__name__}")
        if t.dim() != 2:
            raise InputError(f"{name} has shape {tuple(t.shape)}; expected [batch, seq_len] "
                             "(use .unsqueeze(0) for one sequence)")
        if t.dtype not in ID_DTYPES:
            raise InputError(f"{name} has dtype {t.dtype}; expected an integer tensor (torch.long)")
        if t.numel() == 0:
            raise InputError(f"{name} is empty (shape {tuple(t.shape)}); pass at least one token")
        # Validated before the step: ids outside the vocabulary would fault the device later, far from the cause.
        # Where they are: a GPU tensor is checked on the GPU, only its minimum and maximum read back.
        ids = t.detach().to(torch.int64)
        if name == "input_ids":
            lo, hi = (int(x) for x in torch.aminmax(ids))
            if lo < 0 or hi >= self.config.vocab_size:
                raise InputError(
                    f"input_ids has ids in [{lo}, {hi}] but vocab_size={self.config.vocab_size}; "
                    "check the tokenizer matches the model"
                )
        return ids

    def _positions(self, position_ids: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
        """Packed rows' position ids (where they are), checked; None when every row is one sequence from 0 (then the
        step is exactly the one without position ids)."""
        if position_ids is None:
            return None
        if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in ID_DTYPES:
            raise InputError(f"position_ids must be an integer torch.Tensor [batch, seq_len], got "
                             f"{getattr(position_ids, 'dtype', type(position_ids).__name__)}")
        if position_ids.shape != shape:
            raise InputError(f"position_ids has shape {tuple(position_ids.shape)} but input_ids has {tuple(shape)}; "
                             "give one position per token")
        pos = position_ids.detach().to(torch.int64)
        step_ok = (pos[:, 1:] == 0) | (pos[:, 1:] == pos[:, :-1] + 1)
        if bool((pos[:, 0] != 0).any()) or not bool(step_ok.all()):
            bad = torch.cat([pos[:, :1] != 0, ~step_ok], dim=1).nonzero()[0].tolist()
            raise InputError(f"position_ids row {bad[0]} has {int(pos[bad[0], bad[1]])} at token {bad[1]}; each row "
                             "must be runs of 0, 1, 2, ... (0 where a document starts, the previous + 1 otherwise)")
        if not bool((pos[:, 1:] == 0).any()):
            return None
        return pos

    def _batch(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None) -> Batch:
        ids = self._ids(input_ids, "input_ids")
        lab = self._ids(labels, "labels")
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
        shifted = shift_labels(lab)
        n_tokens = int((shifted != IGNORE_INDEX).sum())
        if n_tokens == 0:
            raise InputError("labels leave no token to predict (all -100 after the shift); check the masking")
        positions = self._positions(position_ids, ids.shape)
        mbs = ids.shape[0] if self.micro_batch_open else self.plan.micro_batch_size
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
        """Tensor -> the compute device without a host sync: a copy from pageable memory would wait for the
        stream's queued work (the previous step), so it goes through pinned memory, which torch's
        pinned allocator keeps until the copy is done. A tensor already pinned (a DataLoader's
        ``pin_memory=True``) is copied from where it is, one on the GPU stays there."""
        if self.device.type != "cuda" or t.device == self.device:
            return t
        if not t.is_cuda:
            # Contiguous first: a strided pinned tensor would be copied through pageable memory.
            t = t.contiguous()
            t = t if t.is_pinned() else t.pin_memory()
        return t.to(self.device, non_blocking=True)
