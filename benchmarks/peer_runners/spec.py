"""What one run is asked to do: system, model shape, batch, optimizer; and the batches themselves.

Every system of a comparison gets the same ``RunSpec`` but for ``system``: the same Llama
shape, sequence length, global batch, micro-batch (the peers accumulate gradients over
it; megatrain takes its micro-batch from its planner), steps, clipping and AdamW
hyper-parameters, and the same seed for the weights and the token batches.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

SYSTEMS = ("megatrain", "pytorch", "fsdp2", "deepspeed", "zero_offload")
DEEPSPEED_SYSTEMS = ("deepspeed", "zero_offload")  # need CUDA, the deepspeed package and its CPU Adam

# Hugging Face LlamaConfig fields. The 1b and 3b shapes are Llama-3.2-1B's and -3B's (tied embeddings),
# with plain RoPE (theta 500000) so that every system computes the same positions at any length.
MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0,
               rms_norm_eps=1e-5),
    "3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0,
               rms_norm_eps=1e-5),
    # Llama-3.1-8B's shape (8.03B parameters, untied embeddings).
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, rope_theta=500000.0,
               rms_norm_eps=1e-5),
}


class NotRun(Exception):
    """A system that cannot run here (no CUDA, not installed): recorded as ``not run: <message>``."""


def model_config(model: str, layers: int | None, seq: int) -> dict[str, Any]:
    """The LlamaConfig fields of ``model`` with ``layers`` decoder layers (None: the shape's own)."""
    if model not in MODELS:
        raise ValueError(f"--model {model!r} is unknown; use one of {', '.join(MODELS)}")
    cfg = dict(MODELS[model], model_type="llama", initializer_range=0.02, use_cache=False,
               max_position_embeddings=max(seq, 4096))
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers {layers} must be >= 1")
        cfg["num_hidden_layers"] = layers
    return cfg


def model_label(model: str, layers: int | None) -> str:
    """``3b`` for the shape itself, ``3b@42L`` for the 3b shape with 42 layers."""
    if layers is None or layers == MODELS[model]["num_hidden_layers"]:
        return model
    return f"{model}@{layers}L"


@dataclass(frozen=True)
class RunSpec:
    """One system's run. ``batch`` sequences of ``seq`` tokens per optimizer step, ``steps`` steps, of
    which the first ``warmup`` are left out of the median; the peers run ``batch // micro_batch``
    micro-batches per step."""

    system: str
    model: str                      # label, e.g. "1b" or "3b@42L"
    config: dict[str, Any]          # LlamaConfig fields
    seq: int
    batch: int
    micro_batch: int
    steps: int
    warmup: int = 1
    device: str = "cpu"             # "cuda" or "cpu"
    seed: int = 0
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    result_path: str = ""           # where the child writes its result (JSON)
    progress_path: str = ""         # where the child appends one JSON line per phase and step
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ValueError(f"system={self.system!r} is unknown; use one of {', '.join(SYSTEMS)}")
        for name in ("seq", "batch", "micro_batch", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if self.batch % self.micro_batch:
            raise ValueError(f"--batch {self.batch} is not a multiple of --micro-batch {self.micro_batch}; "
                             f"every micro-batch must hold as many tokens for the losses to agree")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"--warmup {self.warmup} must leave at least one of --steps {self.steps} to time")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device={self.device!r} must be cuda or cpu")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))

    @property
    def micro_batches(self) -> int:
        return self.batch // self.micro_batch

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step (every token is predicted but the last of each sequence)."""
        return self.batch * self.seq

    def key(self) -> tuple:
        """What makes two runs the same run (for --resume)."""
        return (self.system, self.model, self.seq, self.batch, self.micro_batch, self.device)

    def replace(self, **changes: Any) -> "RunSpec":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunSpec":
        data = json.loads(text)
        data["betas"] = tuple(data["betas"])
        return cls(**data)


def batches(spec: RunSpec):
    """The token batches of every step: ``steps`` + 1 int64 tensors [batch, seq], the same in every system (the
    last is the untimed tail step's, ``child``'s [Note: step timing]).

    Labels are the ids themselves: every system shifts them inside (Hugging Face's convention).
    """
    import torch

    gen = torch.Generator().manual_seed(spec.seed + 1)
    return [torch.randint(0, spec.config["vocab_size"], (spec.batch, spec.seq), generator=gen)
            for _ in range(spec.steps + 1)]
