"""Weights holding NaN or infinity, refused where a model is read and where one is written.

A loaded model with one NaN weight trains with a NaN loss every step; an exported one passes it on to whoever
loads it. Both checks are one reduction (a sum) over tensors already in memory (a loaded block's flat fp32
master, each exported tensor once converted), so their cost is a fraction of the read or write itself;
the error names the tensor and, for a load, its file.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from megatrain.runtime.errors import NonFiniteError


# Elements checked at a time: ``isfinite``'s temporaries stay ~1 MiB, whatever the tensor's size (a load's peak
# RAM is one tensor more than the model's, tests/test_hf_io.py).
CHUNK = 2**18


def finite(values: torch.Tensor) -> bool:
    """Every value of ``values`` finite. Its sum first (one fast reduction, no temporary): a NaN or infinity makes
    it non-finite, so a finite sum settles it; a non-finite one (or finite values summing past the dtype's range)
    is settled exactly, ``isfinite`` a chunk at a time."""
    flat = values.reshape(-1)
    if flat.numel() == 0 or bool(torch.isfinite(flat.sum())):
        return True
    return all(bool(torch.isfinite(part).all()) for part in flat.split(CHUNK))


def _count(values: torch.Tensor) -> int:
    return sum(int(torch.isfinite(part).logical_not().sum()) for part in values.reshape(-1).split(CHUNK))


def check_loaded_block(block: Any, master: torch.Tensor, pieces: Mapping[tuple[int, str], Any],
                       where: Mapping[str, tuple[str, Any]]) -> None:
    """A block just loaded into its flat master ``master``: every value finite, else the first tensor that is not,
    named as in the files (``pieces``: each entry's disk tensors by (block, local name); ``where``: each disk
    tensor's (file, header entry))."""
    if finite(master):
        return
    for entry in block.layout.entries:
        values = master[entry.offset:entry.offset + entry.numel]
        if not finite(values):
            names = [d.name for d in pieces[(block.index, entry.local_name)] if d.name in where]
            path, name = (where[names[0]][0], names[0]) if names else ("the model's files", entry.hf_name)
            raise NonFiniteError(f"{path}: {name} holds {_count(values):,} non-finite value(s) (NaN or infinity); "
                                 f"training it would give a NaN loss every step: use a model whose weights are "
                                 f"finite (re-download or re-export it)")


def check_written(name: str, tensor: torch.Tensor, dtype_name: str) -> None:
    """An exported tensor, in the dtype it is written in: finite (a finite fp32 value past bf16's range is not)."""
    if not finite(tensor):
        raise NonFiniteError(f"{name} holds {_count(tensor):,} non-finite value(s) (NaN or infinity) in {dtype_name}: "
                             f"the weights diverged")
