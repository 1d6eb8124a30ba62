"""Step timing is opt-in: only a step asked for reads clocks and has a breakdown."""
from __future__ import annotations

import types

import torch

from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan
from megatrain.runtime.pipeline import step_timer

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)


def test_only_a_step_asked_for_is_timed(monkeypatch) -> None:
    reads: list[float] = []

    def perf_counter() -> float:
        reads.append(0.0)
        return float(len(reads))

    # The timer's own clock, counted (the AdamW worker keeps the real one).
    monkeypatch.setattr(step_timer, "time", types.SimpleNamespace(perf_counter=perf_counter))
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    for plan in (Plan(checkpoints="host"), Plan(optimizer_mode="eager")):
        with Engine(CONFIG, OptimizerConfig(max_grad_norm=None), plan=plan, compute_dtype=torch.float32,
                    device="cpu") as engine:
            engine.step(ids, ids)
            engine.step(ids, ids)
            assert reads == [] and engine.last_step_breakdown is None  # untimed: no clock read, nothing booked

            engine.time_next_step()
            engine.step(ids, ids)
            timed = len(reads)
            b = engine.last_step_breakdown
            assert timed > 2 and b is not None and b["step_s"] > 0  # the step's span and its copies

            engine.step(ids, ids)  # asked for once: the next step is not timed again
            assert len(reads) == timed and engine.last_step_breakdown is None
            assert engine.logits(ids).shape == (4, 16, 64) and len(reads) == timed  # evaluation is never timed
        reads.clear()
