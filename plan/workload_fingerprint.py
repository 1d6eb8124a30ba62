"""The workload a plan was chosen for (``WorkloadFingerprint``): the model's shape digest, its dtype and the
largest step, which the runtime checks a plan against. Pure stdlib."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

from megatrain.plan.plan_checks import PlanError, at_least, one_of


# The dimensions that decide every parameter's shape, by their Hugging Face config.json names.
SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "attention_bias",
                "o_proj_bias", "mlp_bias", "qk_norm")
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")


def shape_digest(dims: Mapping[str, Any]) -> str:
    """A short stable digest of a model's parameter shapes, from ``SHAPE_FIELDS`` of ``dims``.

    Unset defaults are resolved the way config.json means them (num_key_value_heads: the head count;
    head_dim: hidden_size / heads; o_proj_bias: attention_bias), so the runtime's ModelConfig and the
    planner's ModelShape of one model give the same digest.
    """
    d = {k: dims.get(k) for k in SHAPE_FIELDS}
    d["num_key_value_heads"] = d["num_key_value_heads"] or d["num_attention_heads"]
    d["head_dim"] = d["head_dim"] or int(d["hidden_size"]) // int(d["num_attention_heads"])
    if d["o_proj_bias"] is None:
        d["o_proj_bias"] = d["attention_bias"]
    for k in ("tie_word_embeddings", "attention_bias", "o_proj_bias", "mlp_bias", "qk_norm"):
        d[k] = bool(d[k])
    text = json.dumps([d[k] if isinstance(d[k], bool) else int(d[k]) for k in SHAPE_FIELDS])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class WorkloadFingerprint:
    """The workload a Plan was chosen for. Its memory bounds hold for this model and dtype, and for at
    most ``batch`` sequences of at most ``seq_len`` tokens per step."""

    model: str            # a name for people (preset, folder of config.json)
    params: int           # parameter count, for people
    shape_digest: str     # shape_digest() of the model: what is compared
    seq_len: int
    batch: int
    compute_dtype: str    # "bfloat16", "float16" or "float32"

    def __post_init__(self) -> None:
        if not isinstance(self.shape_digest, str) or not self.shape_digest:
            raise PlanError(f"workload.shape_digest={self.shape_digest!r} must be a non-empty string; "
                            "write the plan again with megatrain-plan")
        for f in ("params", "seq_len", "batch"):
            at_least(f"workload.{f}", getattr(self, f), 1, "write the plan again with megatrain-plan")
        one_of("workload.compute_dtype", self.compute_dtype, COMPUTE_DTYPES)

    def check_model(self, digest: str, compute_dtype: str) -> None:
        """Refuse another model or compute dtype (the plan's memory figures would not hold)."""
        if digest != self.shape_digest:
            raise PlanError(f"this plan was made for {self.model} ({self.params:,} params, shape {self.shape_digest}), "
                            f"not for this model (shape {digest}); plan again for this model with megatrain-plan "
                            "plan, or pass no plan")
        if compute_dtype != self.compute_dtype:
            raise PlanError(f"this plan was made for compute dtype {self.compute_dtype}, not {compute_dtype}; plan "
                            f"again with megatrain-plan plan --dtype, or train in {self.compute_dtype}")

    def check_batch(self, batch: int, seq_len: int) -> None:
        """Refuse a step larger than planned (activation memory grows with it); smaller is fine."""
        if seq_len > self.seq_len:
            raise PlanError(f"sequences of {seq_len} tokens exceed the {self.seq_len} this plan was made for; "
                            f"plan again with megatrain-plan plan --seq-len {seq_len}")
        if batch > self.batch:
            raise PlanError(f"a batch of {batch} sequences exceeds the {self.batch} this plan was made for; "
                            f"plan again with megatrain-plan plan --batch {batch}")


def fingerprint_from_dict(data: Mapping[str, Any]) -> WorkloadFingerprint:
    known = {f.name for f in dataclasses.fields(WorkloadFingerprint)}
    if set(data) != known:
        raise PlanError(f"plan field workload has keys {', '.join(sorted(data))}; expected {', '.join(sorted(known))} "
                        "(write the plan again with megatrain-plan)")
    return WorkloadFingerprint(**data)
