"""The experts' load in a run's metrics: tokens per expert, how unbalanced the routing is, the load-balancing loss.

A mixture-of-experts step leaves its routing on the device (``Engine.routing``: [layers, experts] token counts,
counted by the routers as they route, and the aux loss); the training loop reads it once per step, with the
loss, after the step is done. Each metrics row then carries:

- ``expert_tokens``: per expert, the tokens routed to it, summed over the layers (each token counts once per
  layer for each of its top-k experts; padding positions not counted; over the global batch under data
  parallelism);
- ``expert_load``: per layer, the busiest expert's tokens over the mean per expert (of the counted tokens) (1.0: perfectly balanced;
  ``experts / top_k``: every token to the same k experts: a collapsed router);
- ``expert_load_max``: the largest of those; ``experts_idle``: the fraction of (layer, expert) pairs that
  received no token in the step;
- ``aux_loss``: the load-balancing loss (transformers' ``aux_loss``, unweighted), only when the model trains
  with it; the row's ``loss`` is then the language-model loss alone (the cross-entropy), and
  ``train_objective`` what the step minimised: ``loss`` + ``router_aux_loss_coef`` x ``aux_loss``
  (transformers' ``outputs.loss``).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence


def figures(routing: Any) -> dict[str, Any]:
    """The metrics fields of one step's ``Engine.routing`` (reads its device tensors: call after the step)."""
    out = load_figures(routing.tokens.tolist())
    if routing.aux_loss is not None:
        out["aux_loss"] = float(routing.aux_loss.item())
    return out


def load_figures(tokens: Sequence[Sequence[int]]) -> dict[str, Any]:
    """``tokens[layer][expert]``: the tokens each layer routed to each expert -> the fields above."""
    load = [max(row) * len(row) / sum(row) if sum(row) else 0.0 for row in tokens]
    pairs = sum(len(row) for row in tokens)
    return {"expert_tokens": [int(sum(column)) for column in zip(*tokens)],
            "expert_load": load, "expert_load_max": max(load, default=0.0),
            "experts_idle": sum(1 for row in tokens for n in row if n == 0) / pairs if pairs else 0.0}


def progress_part(record: Mapping[str, Any]) -> str | None:
    """The progress line's routing: ``aux 2.0012  load 1.31x  idle 0%`` (None for a dense model)."""
    if record.get("expert_load_max") is None:
        return None
    aux = f"aux {record['aux_loss']:.4f}  " if record.get("aux_loss") is not None else ""
    return f"{aux}load {record['expert_load_max']:.2f}x  idle {100 * record['experts_idle']:.0f}%"


def summary(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The run summary's routing: the last step's figures and the worst load of the run (empty: dense)."""
    routed = [r for r in records if r.get("expert_load_max") is not None]
    if not routed:
        return {}
    last = routed[-1]
    return {"routing": {"step": last["step"], "expert_load_max": last["expert_load_max"],
                        "experts_idle": last["experts_idle"], "aux_loss": last.get("aux_loss"),
                        "worst_expert_load": max(r["expert_load_max"] for r in routed),
                        "worst_experts_idle": max(r["experts_idle"] for r in routed)}}


def summary_line(s: Mapping[str, Any]) -> list[str]:
    """The summary's routing line (none for a dense model)."""
    r = s.get("routing")
    if not r:
        return []
    aux = f", aux loss {r['aux_loss']:.4f}" if r.get("aux_loss") is not None else ""
    return [f"routing      step {r['step']}: busiest expert {r['expert_load_max']:.2f}x the mean, "
            f"{100 * r['experts_idle']:.1f}% of experts idle{aux}; worst of the run {r['worst_expert_load']:.2f}x, "
            f"{100 * r['worst_experts_idle']:.1f}% idle"]
