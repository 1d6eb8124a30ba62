"""A step's batch refused before anything of it is allocated when its activations cannot fit the device.

``Engine.step`` runs a batch in the plan's micro-batches (the whole batch, for an engine built without a
plan: see runtime/step_inputs.py). A micro-batch's activations, priced by the planner's memory model
(``memory_model.activation_bytes``, what the default plan's kept layers are chosen against), must fit the
memory the device can hold besides the engine (``capacity_bytes``): one row of ten million tokens would
otherwise grow to tens of GB before failing. Checked once per batch shape (host arithmetic, about a
millisecond), never with a device sync; the refusal names the most rows, or the longest row, that fits.
"""
from __future__ import annotations

from typing import Callable

import psutil
import torch

from megatrain.plan.plan import Plan
from megatrain.planner import first_batch
from megatrain.runtime.config import ModelConfig
from megatrain.runtime.errors import InputError


class BatchTooLargeError(InputError):
    """A step's batch whose activations cannot fit the device's memory under the engine's plan."""


def capacity_bytes(device: torch.device) -> int:
    """What the device could give a step's activations: its total memory less what this process holds on it (the
    engine's buffers; a CPU device: the host's memory less this process's resident set). Not the memory free now,
    which other processes move: the default plan's kept layers follow that (step_inputs.py), this bound does not."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1]) - int(torch.cuda.memory_allocated(device))
    return int(psutil.virtual_memory().total) - int(psutil.Process().memory_info().rss)


def check(config: ModelConfig, compute_dtype: torch.dtype, clipping: bool, plan: Plan, micro_batch_open: bool,
          rows: int, seq: int, device: torch.device) -> None:
    """Raise BatchTooLargeError when a micro-batch of this ``rows`` x ``seq`` batch needs more activation memory
    than ``device`` can hold (``micro_batch_open``: the batch is one micro-batch, the default plan's first step)."""
    price = first_batch.activation_pricer(config, str(compute_dtype).removeprefix("torch."), clipping)

    def needs(r: int, s: int) -> int:
        micro = r if micro_batch_open else min(plan.micro_batch_size, r)
        return price(r, s, plan.replace(micro_batch_size=micro))

    room = capacity_bytes(device)
    need = needs(rows, seq)
    if need <= room:
        return
    fits_rows = _largest(lambda r: needs(r, seq) <= room, rows - 1)
    if fits_rows:
        fix = (f"at most {fits_rows} row(s) of {seq} tokens fit at once: pass a plan with "
               f"micro_batch_size={fits_rows} (Plan(micro_batch_size={fits_rows})), or a smaller batch")
    else:
        longest = _largest(lambda s: needs(1, s) <= room, seq - 1)
        fix = (f"the longest row that fits is {longest:,} tokens; shorten the sequences" if longest else
               "not even a short row fits")
    raise BatchTooLargeError(f"a batch of {rows} x {seq:,} tokens needs {need / 2**30:.2f} GiB of activations per "
                             f"micro-batch, more than the {room / 2**30:.2f} GiB {device} can hold besides the engine; "
                             f"{fix}")


def _largest(ok: Callable[[int], bool], high: int) -> int:
    """The largest n in [1, high] with ok(n) (ok monotone: true up to some n), 0 when none."""
    if high < 1 or not ok(1):
        return 0
    lo, hi = 1, high + 1  # ok(lo); not ok(hi) or past the range
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo
