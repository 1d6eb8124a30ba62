"""The model's training state: the block table, the host store (fp32 masters, AdamW m and v, the shadow,
and the per-block AdamW step counts), and the config.json the model came from.

What Hugging Face I/O (``hf_io``) and training checkpoints (``training_checkpoint``) read and write,
instead of the Engine. Every change of a block's fp32 master goes through ``edit_block``, which works
the same whether the master is in RAM or spilled and keeps the compute-dtype shadow in step.

``settle`` (given by the owner) makes the state quiet before it is read or written whole: queued
optimizer updates applied, spill writes landed.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

import torch

from megatrain.models import registry
from megatrain.plan.buffer_kinds import BufferKind

from megatrain.runtime.config import ModelConfig
from megatrain.runtime.errors import InputError
from megatrain.runtime.state.host_store import HostStore
from megatrain.runtime.model.templates import Block, Templates


class ModelState:
    def __init__(self, templates: Templates, store: HostStore, settle: Callable[[], None]) -> None:
        self.templates = templates
        self.config: ModelConfig = templates.config
        self.store = store
        self.settle = settle
        self.hf_config: dict[str, Any] | None = None  # the config.json this model was loaded from, for export

    @property
    def blocks(self) -> tuple[Block, ...]:
        return tuple(self.templates.blocks)

    @property
    def steps(self) -> list[torch.Tensor]:
        """AdamW step count per block, as torch.optim keeps it: a float32 CPU scalar tensor each."""
        return self.store.steps

    def set_steps(self, values: list[float]) -> None:
        """Every block's AdamW step count (a checkpoint's)."""
        if len(values) != len(self.store.steps):
            raise ValueError(f"{len(values)} step counts for {len(self.store.steps)} blocks")
        for step, value in zip(self.store.steps, values):
            step.fill_(value)

    # ---- one block ----------------------------------------------------------------------
    @contextlib.contextmanager
    def edit_block(self, b: int) -> Iterator[torch.Tensor]:
        """Block b's fp32 master ([numel]) to change in place: on leaving the block it is stored (written
        back when spilled) and rounded into the shadow. If the body raises, a spilled master and the shadow
        stay as they were (a RAM master is the store's own memory: it keeps what the body changed)."""
        copied = self.store.copies(BufferKind.MASTER, b)
        master = self.store.read_block(BufferKind.MASTER, b)
        yield master  # spilled (or resident on a GPU): a copy of the block, ours to change
        if copied:
            self.store.write_block(BufferKind.MASTER, b, master)
        self.store.refresh_shadow(b, master)

    def read_block(self, kind: BufferKind, b: int) -> torch.Tensor:
        """Block b's fp32 ``kind`` ([numel]) to read: a view of RAM or a copy of its spill file's block."""
        return self.store.read_block(kind, b)

    # ---- whole state --------------------------------------------------------------------
    def initialize(self, seed: int) -> None:
        """Hugging Face's init: normal(0, initializer_range) weights, zero biases, unit norms (the family's
        ``unit_norm_weight``), zero pad row."""
        std, pad = self.config.initializer_range, self.config.pad_token_id
        unit_norm = registry.family(self.config.model_type).unit_norm_weight
        for block in self.templates.blocks:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + block.index)
            with self.edit_block(block.index) as master:
                views = block.layout.views(master)
                for e in block.layout.entries:
                    t = views[e.local_name]
                    if e.local_name.endswith("norm.weight"):
                        t.fill_(unit_norm)
                    elif e.local_name.endswith(".bias"):
                        t.zero_()
                    else:
                        t.normal_(0.0, std, generator=gen)
                        if e.local_name == "embed_tokens.weight" and pad is not None:
                            t[pad].zero_()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Float32 copies of the master weights under Hugging Face names (tied lm_head included, as HF does)."""
        self.settle()
        out: dict[str, torch.Tensor] = {}
        for block in self.templates.blocks:
            views = block.layout.views(self.read_block(BufferKind.MASTER, block.index))
            for e in block.layout.entries:
                out[e.hf_name] = views[e.local_name].clone()
        if self.config.tie_word_embeddings:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy weights (any float dtype) into the fp32 masters. Keys and shapes must match exactly; nothing
        is changed unless they do."""
        self.settle()
        self._check_state_dict(state_dict)
        for block in self.templates.blocks:
            with self.edit_block(block.index) as master:
                views = block.layout.views(master)
                for entry in block.layout.entries:
                    views[entry.local_name].copy_(state_dict[entry.hf_name])

    def _check_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        expected = {e.hf_name: e for b in self.templates.blocks for e in b.layout.entries}
        optional = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        missing = sorted(set(expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(expected) - optional)
        if missing or unexpected:
            parts = ([f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"] if missing else []) + (
                [f"unexpected {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}"] if unexpected else [])
            raise InputError(f"state_dict does not match this model ({'; '.join(parts)}); check the ModelConfig")
        for name, entry in expected.items():
            tensor = state_dict[name]
            if tuple(tensor.shape) != entry.shape:
                raise InputError(f"{name} has shape {tuple(tensor.shape)}, this model expects {entry.shape}; check the ModelConfig")
            if not tensor.is_floating_point():
                raise InputError(f"{name} has dtype {tensor.dtype}; weights must be floating point")

    def optimizer_state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW state per parameter under Hugging Face names: exp_avg, exp_avg_sq, step (as torch.optim keeps it)."""
        self.settle()
        out: dict[str, dict[str, torch.Tensor]] = {}
        for block in self.templates.blocks:
            m = block.layout.views(self.read_block(BufferKind.EXP_AVG, block.index))
            v = block.layout.views(self.read_block(BufferKind.EXP_AVG_SQ, block.index))
            for e in block.layout.entries:
                out[e.hf_name] = {"exp_avg": m[e.local_name].clone(), "exp_avg_sq": v[e.local_name].clone(),
                                  "step": self.store.steps[block.index].clone()}
        return out

    def block_table(self) -> list[dict[str, int]]:
        """Where each block lives in the flat arrays (element offset, numel), in block order."""
        return [{"offset": self.store.offsets[b.index], "numel": b.layout.numel} for b in self.templates.blocks]

    def tensor_table(self) -> dict[str, dict[str, Any]]:
        """Where each Hugging Face-named parameter lives in the flat arrays (element offset, shape)."""
        return {e.hf_name: {"offset": self.store.offsets[b.index] + e.offset, "shape": list(e.shape)}
                for b in self.templates.blocks for e in b.layout.entries}
