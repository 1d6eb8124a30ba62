"""``megatrain-train``'s options: the command line and ``--config file.toml``, checked and typed into the values
``train_config.build`` makes a ``TrainConfig`` of.

Precedence: built-in defaults < ``--config file.toml`` < command-line options. The TOML file uses
the same names as the options, with underscores (``seq_len = 512`` for ``--seq-len 512``);
an unknown key is an error, as is a value of the wrong type. A new option is a ``TrainConfig`` field (with its
range checked there) and a line of ``HELP`` here (and of ``CHOICES`` when it takes a fixed set of words).
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Mapping, Sequence

from megatrain.planner.commands.cli_args import RenamedOption

from .train_config import COMPUTE_DTYPES, DEVICES, EXPORT_DTYPES, FIELDS, INIT_CHOICES, \
    OPTIMIZER_STATES, PACKING_CHOICES, PROGRESS_STYLES, SPILL_CHOICES, TOKEN_DTYPES, TRAIN_ON_CHOICES, TrainConfig, TrainConfigError, \
    build, relative_to

# One-line help per key (shown by --help); the TOML key is the option name with underscores.
HELP: dict[str, str] = {
    "model": "'demo' (default), a shape preset (e.g. shape:Llama-3.2-1B; random init), a Hugging Face model "
             "directory (its safetensors weights), a Hugging Face Hub name org/name (from the huggingface_hub "
             "cache, HF_HOME/HF_HUB_CACHE, downloaded when missing unless HF_HUB_OFFLINE=1; a local directory of "
             "that name wins), or a config.json (random init)",
    "revision": "with a Hub name: the branch, tag or commit to use (default: main)",
    "init": "auto: a model directory's safetensors weights (default); random: random init from its config",
    "data": "training files or directories: .txt/.md, .jsonl, .parquet, .npy, .bin (default: Python's "
            "pydoc topics)",
    "tokenizer": "a tokenizer.json (needs `tokenizers`) or 'byte' (default: the --model directory's tokenizer.json "
                 "when it has one, else byte; that default is refused at start when transformers' AutoTokenizer "
                 "builds another tokenizer from the directory: given here, the file is used as written)",
    "text_field": "the text field of .jsonl and .parquet records (text)",
    "train_on": "chat records ({\"messages\"} or {\"prompt\", \"completion\"}): completion = loss on the "
                "assistant's tokens only (default), all = on every token",
    "token_dtype": f"element type of .bin token files ({', '.join(TOKEN_DTYPES)}; default uint16)",
    "separator_id": "token between documents (-1: the tokenizer's end-of-text token)",
    "packing": "documents into rows: whole (each document whole in one row, best-fit-decreasing, each "
               "attending only to itself; default for chat data), documents (end to end, cut at row ends, each "
               "attending only to itself), concat (end to end, attending across; default for plain text) or "
               "none (one document per row, truncated and padded)",
    "seq_len": "tokens per sequence (256)",
    "batch": "sequences per optimizer step (8)",
    "shuffle": "shuffle the documents every epoch, seeded by --seed (default on; --no-shuffle: corpus order)",
    "eval_data": "held-out evaluation files or directories (formats as --data)",
    "eval_fraction": "hold out this fraction of --data's documents for evaluation (by document, chosen by --seed; "
                     "0: none)",
    "eval_every": "evaluate every N steps (0: only at the end; needs --eval-data or --eval-fraction)",
    "lr": "peak learning rate (2e-3)",
    "min_lr": "learning rate at the end of the cosine decay (-1: lr / 10)",
    "warmup_steps": "linear warmup steps (-1: 10%% of the steps, at most 1000)",
    "weight_decay": "AdamW weight decay, not applied to norms and biases (0.1)",
    "beta1": "AdamW beta1 (0.9)",
    "beta2": "AdamW beta2 (0.95)",
    "max_grad_norm": "global gradient-norm clipping, 0 = off (1.0)",
    "optimizer_state": "AdamW m and v, in host RAM or spill files: fp32 (default) or bf16 (stochastic rounding, 8 "
                       "instead of 12 bytes/param of state)",
    "steps": "optimizer steps (150)",
    "tokens": "train this many tokens instead of --steps",
    "save_every": "checkpoint every N steps (0: at the end and on Ctrl-C only)",
    "keep": "checkpoints to keep (3)",
    "resume": "continue an earlier run (its --out, or one of its checkpoints), writing into that run "
              "unless --out is given",
    "resume_or_start": "continue the run in --out from its latest complete checkpoint if it has one, else start "
                       "it (for torchrun --max-restarts and a scheduler's requeue); another run's --out is refused",
    "collective_timeout": "under torchrun: seconds a collective waits for the other ranks before every rank stops "
                          "(default: 300 while the ranks check their inputs, then the plan's bound, max(120, 20 "
                          "predicted steps + a checkpoint write))",
    "plan": "a plan.json from megatrain-plan (default: the planner chooses)",
    "spill": "what may live in spill files on disk: auto (the planner decides; default), none, optimizer "
             "(AdamW m, v) or all (master, m, v, grads)",
    "spill_dir": "where spill files go, on a fast local disk (default: OUT/spill)",
    "compute_dtype": "auto (bf16 on a GPU, fp32 on a CPU), bf16 or fp32",
    "device": "auto, cpu or cuda",
    "seed": "random seed of the initial weights, the shuffle and the held-out split (0)",
    "out": "the run directory: metrics.jsonl, summary.json, checkpoints, plot (megatrain-run); it must be "
           "new or empty (see --resume, --overwrite)",
    "trace": "write a torch.profiler Chrome trace of a few steps to OUT/trace.json",
    "progress": "progress display: auto, tqdm, rich, plain or none",
    "log_every": "with plain progress, one line every N steps (10)",
    "plot": "write OUT/training.png when matplotlib is installed (default on; --no-plot)",
    "log_to": "also log metrics to: none (default), tensorboard (OUT/tensorboard; needs tensorboard), wandb "
              "(Weights & Biases: WANDB_PROJECT, WANDB_MODE=offline, WANDB_DIR as wandb reads them; needs wandb), "
              "or several joined by commas: tensorboard,wandb",
    "export_on_finish": "at the end, write the model as megatrain-export does into this new or empty directory",
    "export_dtype": "weight dtype of --export-on-finish: bf16 (default) or fp32",
}

# The options that take one of a fixed set of words.
CHOICES: dict[str, tuple[str, ...]] = {
    "compute_dtype": COMPUTE_DTYPES, "device": DEVICES, "progress": PROGRESS_STYLES, "token_dtype": TOKEN_DTYPES,
    "spill": SPILL_CHOICES, "init": INIT_CHOICES, "train_on": TRAIN_ON_CHOICES,
    "packing": PACKING_CHOICES, "export_dtype": EXPORT_DTYPES, "optimizer_state": OPTIMIZER_STATES}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (not the usage block) and exits with status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise TrainConfigError(f"{message} (see megatrain-train --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="megatrain-train",
        description="Train a language model with fp32 master weights and AdamW state in host memory. "
                    "With no arguments: a demo on text that ships with Python.",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
        epilog="Every option can also be set in a TOML file (--config run.toml) under the same name with "
               "underscores; the command line overrides the file. Exit status: 0 trained; 2 a bad option or input "
               "(one line, nothing written); 3 training diverged (10 updates in a row, or every update of a "
               "shorter run, skipped for a non-finite gradient); 74 a disk that filled up or failed while the run "
               "wrote (the file named); 130 interrupted (Ctrl-C, after a checkpoint); 1 another rank or the export "
               "failed.",
    )
    parser.add_argument("--config", metavar="TOML", help="a TOML file of options (keys as below, with underscores)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the earlier run in --out: delete its metrics, summary, checkpoints, plot and "
                             "trace (nothing else); command line only")
    for name, f in FIELDS.items():
        flag = "--" + name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, help=HELP[name])
        elif name in ("data", "eval_data"):
            parser.add_argument(flag, nargs="+", metavar="PATH", help=HELP[name])
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            parser.add_argument(flag, type=kind, choices=CHOICES.get(name), metavar=name.upper(), help=HELP[name])
    parser.add_argument("--seq", action=RenamedOption, new="--seq-len")
    return parser


def read_toml(path: str) -> dict[str, Any]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ImportError:
            raise TrainConfigError("--config needs Python 3.11+ (tomllib) or `pip install tomli`") from None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise TrainConfigError(f"cannot read config file {path}: {e.strerror}; check the path") from None
    except tomllib.TOMLDecodeError as e:
        raise TrainConfigError(f"{path} is not valid TOML ({e}); fix the file") from None
    return data


def from_mapping(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Check each key and the type of each value; ``source`` names where they came from in errors."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        f = FIELDS.get(key)
        if key == "overwrite":
            raise TrainConfigError(f"{source}: overwrite is a command-line option only (--overwrite), so that "
                                   f"replacing a run is always asked for explicitly")
        if f is None:
            hint = key.replace("-", "_")
            fix = f"did you mean {hint!r}?" if hint in FIELDS else f"valid keys: {', '.join(FIELDS)}"
            raise TrainConfigError(f"{source}: unknown key {key!r}; {fix}")
        out[key] = _coerce(key, str(f.type), value, source)
    return out


def _coerce(key: str, kind: str, value: Any, source: str) -> Any:
    bad = TrainConfigError(f"{source}: {key} = {value!r} should be {_KIND_WORDS.get(kind, kind)}")
    if kind in ("bool", "<class 'bool'>"):
        if not isinstance(value, bool):
            raise bad
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if key in ("data", "eval_data"):
        if isinstance(value, str):
            return (value,)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise bad
        return tuple(value)
    if not isinstance(value, str):
        raise bad
    return value


# The key of ``--config``'s path in the values (a command-line option only, like "overwrite": no TrainConfig field).
CONFIG_FILE = "config"

_KIND_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
               "tuple[str, ...]": "a path or a list of paths"}


def read_values(argv: Sequence[str] | None) -> dict[str, Any]:
    """The options set explicitly: the TOML file's, then the command line's on top (checked, typed)."""
    args = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    overwrite = args.pop("overwrite", False)
    config_path = args.pop("config", None)
    if config_path is not None:
        file_values = from_mapping(read_toml(config_path), config_path)
        # A relative path in the file is relative to the file, as a person reading it would expect.
        base = os.path.dirname(os.path.abspath(config_path))
        for key in ("data", "eval_data", "tokenizer", "plan", "resume", "spill_dir", "out", "model",
                    "export_on_finish"):
            if key in file_values:
                file_values[key] = relative_to(base, key, file_values[key])
        values.update(file_values)
    values.update(from_mapping(args, "command line"))
    if values.get("tokens") == 0:
        raise TrainConfigError("tokens=0 trains nothing; give the tokens to train (e.g. --tokens 1_000_000), or "
                               "leave --tokens out to train --steps steps")
    if overwrite:
        values["overwrite"] = True
    if config_path is not None:
        values[CONFIG_FILE] = config_path  # read, so never inside what --overwrite deletes (tools/run_inputs.py)
    return values




def parse(argv: Sequence[str] | None) -> TrainConfig:
    """Defaults, then the TOML file, then the command line. Raises TrainConfigError (one line)."""
    return build(read_values(argv))
