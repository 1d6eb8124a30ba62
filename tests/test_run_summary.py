"""The summary of a resumed run: the whole run's steps, losses and counts, and the resumed segment's apart."""
from __future__ import annotations

import torch

from megatrain.tools import metrics


def _record(step: int) -> dict:
    return {"step": step, "loss": 10.0 - step, "step_time_s": 1.0, "tokens": 64 * step, "step_tokens": 64,
            "trained_tokens": 10 * step, "step_trained_tokens": 10}


def test_a_resumed_run_summary_describes_the_run_and_the_segment_separately():
    history = [_record(s) for s in range(1, 61)]
    flops = metrics.TokenFlops(model=600.0, attention=0.0, seq=16)
    extra = {"peak_source": "none", "out": "o", "metrics": "m", "checkpoint": "c", "plot": "p",
             "packing": {"mode": "whole", "rows": 120, "positions": 3840, "padding": 384, "documents": 300,
                         "cut": 2, "padding_fraction": 0.1}}
    s = metrics.summarize(history[32:], 100, flops, None, torch.device("cpu"), extra, history=history)
    assert (s["first_step"], s["steps"], s["first_loss"], s["last_loss"]) == (1, 60, 9.0, -50.0)
    assert (s["tokens"], s["trained_tokens"]) == (3840, 600)
    assert s["segment"] == {"first_step": 33, "steps": 60, "first_loss": -23.0, "last_loss": -50.0,
                            "tokens": 28 * 64, "trained_tokens": 280}
    text = metrics.format_summary(s)
    assert "trained steps 1-60: loss 9.0000 -> -50.0000; 3,840 positions processed, 600 labelled tokens" in text
    assert "steps 33-60 (resumed): loss -23.0000 -> -50.0000; 1,792 positions, 280 labelled tokens" in text
    assert "packing      whole: 10.0% of 3,840 positions padding; 2 of 300 documents cut" in text
    fresh = metrics.summarize(history, 100, flops, None, torch.device("cpu"), extra)
    assert fresh["segment"] is None and "(resumed)" not in metrics.format_summary(fresh)
