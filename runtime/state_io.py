"""The Engine's state in and out of files: Hugging Face directories and training checkpoints.

One ``StateIO`` per engine, chosen with its model state at construction (``open_state``): a single process's
state writes and reads its own arrays; a data-parallel rank's state writes its shards into the same
checkpoint as the other ranks and reads any world size's checkpoint into its shards ([Note: sharded
checkpoints]), and only rank 0 writes a Hugging Face directory while the others serve its reads. Either way
every rank calls the same methods. The modules that own the bytes are io/'s: ``hf_io``,
``training_checkpoint``, ``sharded_checkpoint``.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping, NamedTuple, Protocol

import torch

from megatrain.runtime.distributed.collectives import Collectives
from megatrain.runtime.distributed.sharded_state import ShardedModelState
from megatrain.runtime.errors import InputError
from megatrain.runtime.io import hf_io, sharded_checkpoint, training_checkpoint
from megatrain.runtime.io.training_checkpoint import CheckpointHandle, CheckpointWriter, Restored
from megatrain.runtime.model.templates import Templates
from megatrain.runtime.paths import user_path
from megatrain.runtime.state.host_store import HostStore
from megatrain.runtime.state.model_state import ModelState


class StateIO(Protocol):
    def save_pretrained(self, path: str | os.PathLike, dtype: torch.dtype, max_shard_bytes: int,
                        allow_nonfinite: bool = False) -> None:
        """A Hugging Face directory of the weights (every rank calls it)."""

    def save_checkpoint(self, step: int, settings: dict[str, Any], directory: str | os.PathLike,
                        extra: Mapping[str, object] | None, keep: int, blocking: bool) -> CheckpointHandle:
        """The training state at optimizer step ``step`` into ``directory/step-<N>`` (every rank calls it)."""

    def restore(self, path: str, manifest: dict[str, Any]) -> Restored:
        """The state of the checkpoint at ``path`` (a step directory), verified; what training continues from."""

    def wait(self) -> str | None:
        """Wait for the checkpoint being written (raising its error, if any); its directory, or None."""

    def close(self) -> None:
        """A background write finishes before the state goes."""


def open_state(templates: Templates, store: HostStore, settle: Callable[[], None],
               collectives: Collectives | None) -> tuple[ModelState, StateIO]:
    """The model state over ``store`` (a rank's shards under data parallelism) and its files in and out."""
    if collectives is None:
        state = ModelState(templates, store, settle)
        return state, LocalStateIO(state)
    sharded = ShardedModelState(templates, store, settle, collectives)
    return sharded, ShardedStateIO(sharded)


class LocalStateIO:
    """One process's state: the whole model in its store."""

    def __init__(self, state: ModelState) -> None:
        self.state = state
        self.writer: CheckpointWriter | None = None  # created on the first save

    def save_pretrained(self, path: str | os.PathLike, dtype: torch.dtype, max_shard_bytes: int,
                        allow_nonfinite: bool = False) -> None:
        hf_io.save_pretrained(self.state, path, dtype, max_shard_bytes, allow_nonfinite)

    def save_checkpoint(self, step: int, settings: dict[str, Any], directory: str | os.PathLike,
                        extra: Mapping[str, object] | None, keep: int, blocking: bool) -> CheckpointHandle:
        """Not blocking unless asked: the state is snapshotted and written in the background
        ([Note: asynchronous checkpoints])."""
        return self._writer().save(self.state, step, settings, directory, extra, keep, blocking)

    def restore(self, path: str, manifest: dict[str, Any]) -> Restored:
        return training_checkpoint.restore(self.state, path, manifest)

    def wait(self) -> str | None:
        return None if self.writer is None else self.writer.wait()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def _writer(self) -> CheckpointWriter:
        if self.writer is None:
            self.writer = CheckpointWriter()
        return self.writer


class ShardedStateIO(LocalStateIO):
    """A data-parallel rank's state: its shard of every block."""

    def __init__(self, state: ShardedModelState) -> None:
        super().__init__(state)
        self.sharded = state

    def save_pretrained(self, path: str | os.PathLike, dtype: torch.dtype, max_shard_bytes: int,
                        allow_nonfinite: bool = False) -> None:
        """Rank 0 writes, gathering block by block; the other ranks serve its reads."""
        self.sharded.on_first_rank(lambda: hf_io.save_pretrained(self.sharded, path, dtype, max_shard_bytes,
                                                                        allow_nonfinite))

    def save_checkpoint(self, step: int, settings: dict[str, Any], directory: str | os.PathLike,
                        extra: Mapping[str, object] | None, keep: int, blocking: bool) -> CheckpointHandle:
        """Every rank writes its shards; blocking ([Note: sharded checkpoints]), so the handle is committed."""
        path = sharded_checkpoint.save(self.sharded, self._writer(), step, settings, directory, extra, keep)
        return CheckpointHandle(path)  # committed: wait() returns it

    def restore(self, path: str, manifest: dict[str, Any]) -> Restored:
        """This rank's shards of any world size's checkpoint."""
        return sharded_checkpoint.restore(self.sharded, path, manifest)


# ---------------------------------------------------------------------- what an Engine is built from
class Pretrained(NamedTuple):
    hf_config: dict[str, Any]  # its config.json
    files: list[str]  # its safetensors files


class Checkpoint(NamedTuple):
    path: str  # the step directory
    manifest: dict[str, Any]
    arguments: dict[str, Any]  # the Engine(...) keyword arguments it records


def find_pretrained(path: str | os.PathLike) -> Pretrained:
    """A Hugging Face model directory's config.json and weight files."""
    path = user_path(path, "path")
    if not os.path.isdir(path):
        raise InputError(f"{path} is not a directory; pass a Hugging Face model directory "
                         "(config.json + *.safetensors)")
    return Pretrained(hf_io.read_config(path), hf_io.find_shards(path))


def load_pretrained(state: ModelState, files: list[str]) -> None:
    """The weight files streamed tensor by tensor into the fp32 masters (every rank: its shards)."""
    hf_io.load_weights(state, files)


def find_checkpoint(directory: str | os.PathLike) -> Checkpoint:
    """The checkpoint ``directory/latest`` names (or a ``step-<N>`` directory itself), its manifest and the
    Engine's arguments it records."""
    path = training_checkpoint.resolve(directory)
    manifest = training_checkpoint.read_manifest(path)
    return Checkpoint(path, manifest, training_checkpoint.engine_arguments(manifest))
