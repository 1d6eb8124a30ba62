"""Where each step's metrics go besides OUT/metrics.jsonl (``--log-to``): nowhere, or TensorBoard.

    sink = metric_sinks.open(config, out_dir, start_step)   # after the run directory is taken
    sink.log(step, record)                                  # each finished step's metrics record
    sink.close()                                            # at the end of the run (also on error)

``check(config)`` says in one line what is missing before anything is written (the training
command calls it with the other input checks). TensorBoard: the ``tensorboard`` package's event
files under ``OUT/tensorboard`` (``tensorboard --logdir OUT``), every number of the record as a
scalar ``train/<name>`` (an evaluation's ``eval_<name>`` as ``eval/<name>``); a resumed run purges the events after its checkpoint's step, as it does
the rows of metrics.jsonl.
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping, Protocol

from .train_config import TrainConfig, TrainConfigError

TENSORBOARD_DIR = "tensorboard"


class MetricSink(Protocol):
    def log(self, step: int, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """``--log-to none``: metrics.jsonl only."""

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardSink:
    """Scalars into ``directory`` through ``torch.utils.tensorboard.SummaryWriter`` (the tensorboard package)."""

    def __init__(self, directory: str, start_step: int = 0) -> None:
        writer_class = _summary_writer()
        # purge_step: events an earlier attempt wrote after the step this run resumes from are dropped.
        self._writer = writer_class(log_dir=directory, purge_step=start_step + 1 if start_step else None)

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        for name, value in record.items():
            if name == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                tag = f"eval/{name[len('eval_'):]}" if name.startswith("eval_") else f"train/{name}"
                self._writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self._writer.close()


def check(config: TrainConfig) -> None:
    """What ``config.log_to`` needs is installed (one line naming the fix otherwise). Writes nothing."""
    if config.log_to == "tensorboard":
        _summary_writer()


def open(config: TrainConfig, out_dir: str, start_step: int = 0) -> MetricSink:  # noqa: A001 (the sink's verb)
    """The sink ``config.log_to`` names, writing under ``out_dir``."""
    if config.log_to == "tensorboard":
        return TensorBoardSink(os.path.join(out_dir, TENSORBOARD_DIR), start_step)
    return NullSink()


def _summary_writer() -> Any:
    try:
        import tensorboard  # noqa: F401  (torch's writer needs the package; a clear line if it is missing)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise TrainConfigError("log_to: tensorboard needs the tensorboard package; pip install tensorboard (it is in "
                               "megatrain's train extra), or leave --log-to out") from None
    return SummaryWriter
