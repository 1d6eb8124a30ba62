"""Where each step's metrics go besides OUT/metrics.jsonl (``--log-to``): nowhere, TensorBoard, Weights & Biases,
or several of them (``--log-to tensorboard,wandb``).

    sink = metric_sinks.open(config, out_dir, start_step)   # after the run directory is taken
    sink.log(step, record)                                  # each finished step's metrics record
    sink.close(summary)                                     # at the end of the run (None on an error)

``check(config)`` says in one line what is missing before anything is written (the training
command calls it with the other input checks). TensorBoard: the ``tensorboard`` package's event
files under ``OUT/tensorboard`` (``tensorboard --logdir OUT``), every number of the record as a
scalar ``train/<name>`` (an evaluation's ``eval_<name>`` as ``eval/<name>``; the per-expert and per-layer lists
a scalar per entry, ``train/expert_tokens/expert_3``, ``train/expert_load/layer_0``; the step's time breakdown
``train/breakdown/<phase>``); a resumed run purges the events after its checkpoint's step, as it does
the rows of metrics.jsonl. Weights & Biases: ``wandb.init`` with the run's options as its config (project
``WANDB_PROJECT``, else megatrain; its files under ``WANDB_DIR/wandb``, else ``OUT/wandb``; ``WANDB_MODE=offline``
as wandb reads it), the same scalars by the same names, the run's summary.json as its summary; a resumed run
continues the same wandb run (its id kept in ``OUT/wandb/run_id``).
"""
from __future__ import annotations

import math
import os
import uuid
from builtins import open as builtins_open
from typing import Any, Mapping, Protocol

from .train_config import TrainConfig, TrainConfigError, log_targets

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
WANDB_RUN_ID = "run_id"  # in OUT/wandb: the wandb run a resumed run continues


class MetricSink(Protocol):
    def log(self, step: int, record: Mapping[str, Any]) -> None: ...

    def close(self, summary: Mapping[str, Any] | None = None) -> None: ...


class NullSink:
    """``--log-to none``: metrics.jsonl only."""

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        pass

    def close(self, summary: Mapping[str, Any] | None = None) -> None:
        pass


class Sinks:
    """Several sinks, each given every record and the summary."""

    def __init__(self, sinks: list[MetricSink]) -> None:
        self._sinks = sinks

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        for sink in self._sinks:
            sink.log(step, record)

    def close(self, summary: Mapping[str, Any] | None = None) -> None:
        for sink in self._sinks:
            sink.close(summary)


class TensorBoardSink:
    """Scalars into ``directory`` through ``torch.utils.tensorboard.SummaryWriter`` (the tensorboard package)."""

    def __init__(self, directory: str, start_step: int = 0) -> None:
        writer_class = _summary_writer()
        # purge_step: events an earlier attempt wrote after the step this run resumes from are dropped.
        self._writer = writer_class(log_dir=directory, purge_step=start_step + 1 if start_step else None)

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=step)

    def close(self, summary: Mapping[str, Any] | None = None) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run: the options as its config, each record's scalars, summary.json as its summary."""

    def __init__(self, out_dir: str, config: Mapping[str, Any], start_step: int = 0) -> None:
        wandb = _wandb()
        own_dir = os.path.join(out_dir, WANDB_DIR)
        os.makedirs(own_dir, exist_ok=True)
        id_file = os.path.join(own_dir, WANDB_RUN_ID)
        run_id = None
        if start_step and os.path.isfile(id_file):  # a resumed run continues its wandb run
            with builtins_open(id_file, encoding="utf-8") as f:
                run_id = f.read().strip() or None
        run_id = run_id or uuid.uuid4().hex[:12]
        with builtins_open(id_file, "w", encoding="utf-8") as f:
            f.write(run_id)
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "megatrain", id=run_id, resume="allow",
                               name=os.path.basename(os.path.abspath(out_dir)), config=dict(config),
                               dir=os.environ.get("WANDB_DIR") or out_dir,  # wandb writes DIR/wandb/
                               settings=wandb.Settings(console="off", silent=True))

    def log(self, step: int, record: Mapping[str, Any]) -> None:
        self._run.log(scalars(record), step=step)

    def close(self, summary: Mapping[str, Any] | None = None) -> None:
        if summary is not None:
            self._run.summary.update(dict(summary))
        self._run.finish(exit_code=int(summary.get("exit_code") or 0) if summary is not None else 1)


# What the entries of a list field count, for their tags (``train/expert_tokens/expert_3``); others: ``item_<i>``.
_ENTRIES = {"expert_tokens": "expert", "expert_load": "layer"}


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """Every finite number of a metrics record by its tag: ``train/<name>``, an evaluation's ``eval/<name>``; a list
    (per expert, per layer) as a scalar per entry, ``train/expert_tokens/expert_3``; a dict (the step's
    ``breakdown``) as a scalar per key, ``train/breakdown/compute_s``."""
    out: dict[str, float] = {}
    for name, value in record.items():
        if name == "step":
            continue
        tag = f"eval/{name[len('eval_'):]}" if name.startswith("eval_") else f"train/{name}"
        if isinstance(value, (list, tuple)):
            entry = _ENTRIES.get(name, "item")
            _add(out, {f"{tag}/{entry}_{i}": v for i, v in enumerate(value)})
        elif isinstance(value, Mapping):
            _add(out, {f"{tag}/{key}": v for key, v in value.items()})
        else:
            _add(out, {tag: value})
    return out


def _add(out: dict[str, float], values: Mapping[str, Any]) -> None:
    """The finite numbers of ``values`` (not booleans, strings or None) into ``out``."""
    for tag, value in values.items():
        if not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value):
            out[tag] = value


def check(config: TrainConfig) -> None:
    """What ``config.log_to`` needs is installed (one line naming the fix otherwise). Writes nothing."""
    targets = log_targets(config.log_to)
    if "tensorboard" in targets:
        _summary_writer()
    if "wandb" in targets:
        _wandb()


def open(config: TrainConfig, out_dir: str, start_step: int = 0) -> MetricSink:  # noqa: A001 (the sink's verb)
    """The sinks ``config.log_to`` names, writing under ``out_dir``."""
    sinks: list[MetricSink] = []
    for target in log_targets(config.log_to):
        if target == "tensorboard":
            sinks.append(TensorBoardSink(os.path.join(out_dir, TENSORBOARD_DIR), start_step))
        elif target == "wandb":
            sinks.append(WandbSink(out_dir, config.to_dict(), start_step))
    return sinks[0] if len(sinks) == 1 else Sinks(sinks) if sinks else NullSink()


def _wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise TrainConfigError("log_to: wandb needs the wandb package; pip install wandb (megatrain's wandb extra), "
                               "or leave wandb out of --log-to") from None
    return wandb


def _summary_writer() -> Any:
    try:
        import tensorboard  # noqa: F401  (torch's writer needs the package; a clear line if it is missing)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise TrainConfigError("log_to: tensorboard needs the tensorboard package; pip install tensorboard (it is in "
                               "megatrain's train extra), or leave --log-to out") from None
    return SummaryWriter
