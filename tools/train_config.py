"""The training command's configuration: one frozen dataclass, validated on construction, and what a resumed
run may change of it. Read from a TOML file and the command line by ``train_options``.

Every error is one line that names the key, the value and the fix (``TrainConfigError``); the command prints
it and exits with status 2.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from megatrain.runtime import config_ranges
from megatrain.runtime.errors import MegatrainError

from . import hub_models

# The built-in demo model's name for --model (a few million parameters, Llama-shaped, random init).
DEMO_MODEL = "demo"
COMPUTE_DTYPES = ("auto", "bf16", "fp32")
DEVICES = ("auto", "cpu", "cuda")
PROGRESS_STYLES = ("auto", "tqdm", "rich", "plain", "none")
TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")
SPILL_CHOICES = ("auto", "none", "optimizer", "all")
OPTIMIZER_STATES = ("fp32", "bf16")
INIT_CHOICES = ("auto", "random")
TRAIN_ON_CHOICES = ("completion", "all")
# --log-to's targets: one, or several joined by commas ("tensorboard,wandb").
LOG_TO_CHOICES = ("none", "tensorboard", "wandb")
PACKING_CHOICES = ("auto", "whole", "documents", "concat", "none")
# Options a resumed run cannot change: they define the model, its optimizer state or the data position.
# The others (lr, steps, save cadence, plan, device, ...) apply from the resume on, and are printed.
FIXED_ON_RESUME = ("model", "revision", "init", "data", "tokenizer", "text_field", "train_on", "token_dtype",
                   "separator_id", "seq_len", "packing", "batch", "compute_dtype", "seed", "shuffle", "eval_fraction",
                   "beta1", "beta2", "weight_decay", "max_grad_norm")
PATH_KEYS = ("data", "eval_data", "tokenizer", "plan", "spill_dir", "model", "export_on_finish")
EXPORT_DTYPES = ("bf16", "fp32")


class TrainConfigError(MegatrainError):
    """A training option or config-file key is invalid. One line: the key, the value, the fix."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything one ``megatrain-train`` run needs. Field names are the TOML keys."""

    # What to train: "demo", a planner preset (random init, e.g. "shape:Llama-3.2-1B"), a Hugging Face
    # model directory (its *.safetensors weights), a Hugging Face Hub name ("org/name", tools/hub_models.py;
    # a local directory of that name wins), or a config.json (random init).
    model: str = DEMO_MODEL
    # A Hub name's branch, tag or commit (empty: main).
    revision: str = ""
    # "auto": a model directory's weights (refused when it has none megatrain reads); "random": random init.
    init: str = "auto"
    # Training text or tokens: files or directories (.txt/.md, .jsonl, .parquet, .npy, .bin).
    # Empty: the Python standard library's pydoc topics (the demo corpus).
    data: tuple[str, ...] = ()
    # A tokenizer.json (needs the `tokenizers` package), or "byte" (256 byte values + a separator).
    # Not given: the --model directory's tokenizer.json when it has one (see ``build``), else "byte".
    tokenizer: str = "byte"
    text_field: str = "text"
    # Chat records ({"messages"} or {"prompt", "completion"}): "completion" labels the assistant's tokens
    # only (the rest is -100); "all" labels every token.
    train_on: str = "completion"
    # Element type of raw .bin token files.
    token_dtype: str = "uint16"
    # Token placed between documents; -1: the tokenizer's end-of-text token.
    separator_id: int = -1
    # How documents become rows (tools/packing.py): "whole" (each document whole in one row, rows filled
    # best-fit-decreasing, attention and positions restart at each document), "documents" (end to end, cut
    # at row ends, attention and positions restart at each document), "concat" (end to end, a token sees the
    # earlier documents of its row), "none" (one document per row, truncated and padded); "auto": whole for
    # chat records, concat for plain text.
    packing: str = "auto"
    seq_len: int = 256
    batch: int = 8
    # A seeded shuffle of the documents every epoch (--no-shuffle: corpus order); see tools/data_order.py.
    shuffle: bool = True
    # Held-out evaluation: separate files, or a fraction of --data's documents (by document, fixed by --seed).
    eval_data: tuple[str, ...] = ()
    eval_fraction: float = 0.0
    # Evaluate every N steps (0: only at the end, when there is an eval set).
    eval_every: int = 0
    lr: float = 2e-3
    # Cosine decay ends at min_lr; -1 means lr / 10.
    min_lr: float = -1.0
    # Linear warmup steps; -1 means 10% of the steps (at most 1000).
    warmup_steps: int = -1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    # Global-norm gradient clipping; 0 turns clipping off (and allows the eager optimizer).
    max_grad_norm: float = 1.0
    # AdamW m and v in host RAM: "fp32" or "bf16" (stochastic rounding; 8 instead of 12 bytes/param of state).
    optimizer_state: str = "fp32"
    steps: int = 150
    # When > 0, train this many tokens instead: steps = ceil(tokens / (batch x seq_len)).
    tokens: int = 0
    # Checkpoint every N steps (0: only at the end and on Ctrl-C).
    save_every: int = 0
    keep: int = 3
    # A checkpoint directory (or a previous --out) to continue from.
    resume: str = ""
    # Resume from the latest complete checkpoint in --out if there is one, else start (restarts, requeues).
    resume_or_start: bool = False
    # Seconds a collective may wait for the other ranks before every rank stops (0: the default, 300).
    collective_timeout: float = 0.0
    # A plan.json from megatrain-plan; empty: the planner chooses one for this machine.
    plan: str = ""
    # What may live in spill files on disk: "auto" (the planner decides), "none", "optimizer" (m, v), "all".
    spill: str = "auto"
    # Where spill files go; empty: OUT/spill.
    spill_dir: str = ""
    compute_dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    out: str = "megatrain-run"
    # Record a torch.profiler Chrome trace of a few steps into OUT/trace.json.
    trace: bool = False
    progress: str = "auto"
    # Non-interactive progress: one line every N steps.
    log_every: int = 10
    plot: bool = True
    # Where metrics go besides OUT/metrics.jsonl: "none", "tensorboard" (OUT/tensorboard; needs tensorboard),
    # "wandb" (Weights & Biases; needs wandb), or several joined by commas ("tensorboard,wandb").
    log_to: str = "none"
    # At the end of the run, export the model as megatrain-export does into this new or empty directory.
    export_on_finish: str = ""
    export_dtype: str = "bf16"

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", tuple(self.data))
        object.__setattr__(self, "eval_data", tuple(self.eval_data))
        for name in ("seq_len", "batch", "keep", "log_every"):
            _require(self, name, getattr(self, name) >= 1, "must be >= 1")
        _require(self, "seq_len", self.seq_len >= 2, "must be >= 2 (a token and the one it predicts)")
        for name in ("steps", "tokens", "save_every", "seed", "eval_every"):
            _require(self, name, getattr(self, name) >= 0, "must be >= 0")
        _require(self, "steps", self.steps >= 1 or self.tokens > 0, "must be >= 1 (or set --tokens)")
        _require(self, "collective_timeout", 0 <= self.collective_timeout < math.inf, "must be seconds >= 0")
        _require(self, "resume_or_start", not (self.resume_or_start and self.resume),
                 "takes the run in --out; leave --resume out")
        _require(self, "lr", 0 < self.lr <= config_ranges.LR_MAX,
                 f"must be a positive number <= {config_ranges.LR_MAX:g} (no real run uses more), e.g. 3e-4")
        _require(self, "min_lr", self.min_lr == -1.0 or 0 <= self.min_lr <= self.lr,
                 f"must be in [0, lr={self.lr}] (or -1 for lr / 10)")
        _require(self, "warmup_steps", self.warmup_steps >= -1, "must be >= 0 (or -1 for 10% of the steps)")
        _require(self, "weight_decay", 0 <= self.weight_decay <= config_ranges.WEIGHT_DECAY_MAX,
                 f"must be in [0, {config_ranges.WEIGHT_DECAY_MAX:g}] (no real run uses more), e.g. 0.1")
        product = config_ranges.decay_product(self.lr, self.weight_decay)
        if product:
            raise TrainConfigError(product)
        for name in ("beta1", "beta2"):
            _require(self, name, 0 <= getattr(self, name) < 1, "must be in [0, 1), e.g. 0.9 / 0.95")
        _require(self, "max_grad_norm", 0 <= self.max_grad_norm < math.inf, "must be a finite number >= 0 (0 turns "
                 "clipping off)")
        _one_of("compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
        _one_of("device", self.device, DEVICES)
        _one_of("progress", self.progress, PROGRESS_STYLES)
        _one_of("token_dtype", self.token_dtype, TOKEN_DTYPES)
        _one_of("spill", self.spill, SPILL_CHOICES)
        _one_of("optimizer_state", self.optimizer_state, OPTIMIZER_STATES)
        _one_of("init", self.init, INIT_CHOICES)
        _one_of("train_on", self.train_on, TRAIN_ON_CHOICES)
        log_targets(self.log_to)
        _one_of("packing", self.packing, PACKING_CHOICES)
        _one_of("export_dtype", self.export_dtype, EXPORT_DTYPES)
        _require(self, "eval_fraction", 0 <= self.eval_fraction < 1 and math.isfinite(self.eval_fraction),
                 "must be in [0, 1): the fraction of the documents held out for evaluation, e.g. 0.05")
        if self.eval_data and self.eval_fraction:
            raise TrainConfigError("eval_data and eval_fraction both given; hold out a fraction of --data or give "
                                   "--eval-data, not both")
        _require(self, "separator_id", self.separator_id >= -1, "must be a token id >= 0 (or -1 for the tokenizer's)")
        _require(self, "out", bool(self.out), "must name an output directory")
        _require(self, "revision", not self.revision or hub_models.is_hub_name(self.model),
                 "applies to a Hugging Face Hub name only (--model org/name); leave it out")
        for key in ("data", "eval_data"):
            for path in getattr(self, key):
                if not os.path.exists(path):
                    raise TrainConfigError(f"{key}: {path} does not exist; pass text, .jsonl, .parquet, .npy or "
                                           f".bin files or a directory of them")
        if self.tokenizer != "byte" and not os.path.exists(self.tokenizer):
            raise TrainConfigError(f"tokenizer: {self.tokenizer} does not exist; pass a tokenizer.json or 'byte'")
        if self.plan and not os.path.exists(self.plan):
            raise TrainConfigError(f"plan: {self.plan} does not exist; write one with megatrain-plan plan --out "
                                   f"plan.json, or leave --plan out to let the planner choose")
        if self.resume and not os.path.exists(self.resume):
            raise TrainConfigError(f"resume: {self.resume} does not exist; pass a checkpoint directory or the "
                                   f"--out of an earlier run")

    @property
    def total_steps(self) -> int:
        if self.tokens > 0:
            return -(-self.tokens // (self.batch * self.seq_len))
        return self.steps

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["data"] = list(self.data)
        d["eval_data"] = list(self.eval_data)
        return d


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig)}

def build(values: Mapping[str, Any]) -> TrainConfig:
    values = {k: v for k, v in values.items() if k not in ("overwrite", "config")}  # command-line only
    model = values.get("model")
    if "tokenizer" not in values and isinstance(model, str) and model != DEMO_MODEL:
        if hub_models.is_hub_name(model):  # its snapshot in the Hugging Face cache (downloaded when missing)
            revision = values.get("revision", "")
            model = hub_models.snapshot(model, revision if isinstance(revision, str) else "")
        if os.path.isfile(os.path.join(model, "tokenizer.json")):
            values["tokenizer"] = os.path.join(model, "tokenizer.json")  # a model directory's own tokenizer
    try:
        return TrainConfig(**values)
    except TypeError as e:  # a value of the wrong type reached a comparison
        raise TrainConfigError(f"invalid option value ({e})") from None


def absolute_paths(config: TrainConfig) -> dict[str, Any]:
    """``config.to_dict()`` with its input paths absolute (what a checkpoint records: valid from any directory)."""
    d = config.to_dict()
    d["data"] = [os.path.abspath(p) for p in config.data]
    d["eval_data"] = [os.path.abspath(p) for p in config.eval_data]
    if config.export_on_finish:
        d["export_on_finish"] = os.path.abspath(config.export_on_finish)
    for key in ("tokenizer", "plan", "spill_dir", "model"):
        d[key] = relative_to(os.getcwd(), key, d[key])
        if d[key] and os.path.exists(d[key]):
            d[key] = os.path.abspath(d[key])
    return d


def compared_options(config: TrainConfig) -> dict[str, Any]:
    """The options every rank of a run shares (tools/ranks.py compares them): not --spill-dir (a node's own, on its
    local disk), nor --out (compared as the directory each rank sees: Ranks.take_run_directory)."""
    return {**absolute_paths(config), "spill_dir": None, "out": None}


def resume_changes(saved: Mapping[str, Any], given: Mapping[str, Any]) -> list[str]:
    """The options given now that differ from the resumed run's, as "name old -> new" (those it may change).

    Raises TrainConfigError for one it cannot change (``FIXED_ON_RESUME``).
    """
    changes = []
    for key, value in given.items():
        if key not in FIELDS or key in ("resume", "out"):
            continue
        old = saved.get(key, getattr(TrainConfig, key, None))
        if _same(key, old, value):
            continue
        if key in FIXED_ON_RESUME:
            flag = "--" + key.replace("_", "-")
            raise TrainConfigError(f"resume: {flag} {_show(value)} differs from the resumed run's {_show(old)}; "
                                   f"{key} cannot change in a resumed run: leave {flag} out, or start a new run "
                                   f"with a new --out")
        changes.append(f"{key} {_show(old)} -> {_show(value)}")
    return changes


def _same(key: str, old: Any, new: Any) -> bool:
    if key in PATH_KEYS:
        def norm(v: Any) -> Any:
            paths = [v] if isinstance(v, str) else list(v or ())
            return [os.path.realpath(p) if p and os.path.exists(p) else p for p in paths]
        return norm(old) == norm(new)
    if isinstance(old, (int, float)) and isinstance(new, (int, float)) and not isinstance(old, bool):
        return float(old) == float(new)
    return old == new


def _show(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) or "(none)"
    return str(value) if value != "" else "(none)"


def relative_to(base: str, key: str, value: Any) -> Any:
    """A path option's value relative to ``base`` (a preset name, \"demo\" and \"byte\" left as they are)."""
    def fix(p: str) -> str:
        if key == "model" and not (os.sep in p or p.endswith(".json")):
            return p  # a preset name or "demo"
        if key == "model" and hub_models.is_hub_name(p, base):
            return p  # a Hugging Face Hub name (no such directory here)
        if key == "tokenizer" and p == "byte":
            return p
        return p if os.path.isabs(p) or not p else os.path.join(base, p)
    return tuple(fix(p) for p in value) if isinstance(value, tuple) else fix(value)


def log_targets(log_to: str) -> tuple[str, ...]:
    """``--log-to``'s targets, in order ("none": none); one line naming the choices for anything else."""
    targets = tuple(t.strip() for t in str(log_to).split(","))
    if any(t not in LOG_TO_CHOICES for t in targets) or ("none" in targets and len(targets) > 1) \
            or len(set(targets)) < len(targets):
        raise TrainConfigError(f"log_to={log_to!r} is not one of {', '.join(LOG_TO_CHOICES)} (or several of "
                               f"tensorboard, wandb joined by commas, e.g. tensorboard,wandb)")
    return () if targets == ("none",) else targets


def _require(config: TrainConfig, name: str, ok: bool, what: str) -> None:
    if not ok:
        raise TrainConfigError(f"{name}={getattr(config, name)!r} {what}")


def _one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise TrainConfigError(f"{name}={value!r} is not one of {', '.join(choices)}")


__all__ = ["TrainConfig", "TrainConfigError", "build", "DEMO_MODEL"]
