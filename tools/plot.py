"""The end-of-run figure: loss (and eval loss) and throughput against the step, as a PNG (when matplotlib is
installed)."""
from __future__ import annotations

from typing import Any


def plot(records: list[dict[str, Any]], path: str) -> str:
    """Write the figure to ``path``; returns where it went, or why there is none (no matplotlib, no steps)."""
    if not records:
        return "none (no steps)"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped (matplotlib is not installed; pip install matplotlib)"
    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_tps) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_loss.plot(steps, [r["loss"] for r in records], lw=1, label="train")
    evaluated = [r for r in records if r.get("eval_loss") is not None]
    if evaluated:
        ax_loss.plot([r["step"] for r in evaluated], [r["eval_loss"] for r in evaluated], "o-", ms=4, lw=1,
                     color="tab:green", label="eval (held out)")
        ax_loss.legend()
    ax_loss.set_ylabel("loss")
    ax_loss.grid(alpha=0.3)
    ax_tps.plot(steps, [r["tokens_per_second"] for r in records], lw=1, color="tab:orange")
    ax_tps.set_ylabel("tokens / s")
    ax_tps.set_xlabel("step")
    ax_tps.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
