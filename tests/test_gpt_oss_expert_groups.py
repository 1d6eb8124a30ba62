"""gpt-oss streamed in expert groups ([Note: expert groups]): a group carries its experts' rows of the fused
tensors and of their biases; the model trains as the whole layer does and as transformers does, the expert no
token reaches included (zero gradient, biases too, decayed by AdamW), and with the load-balancing loss on (the
dense part routes under the forward's observer, its recompute takes the loss's gradient)."""
from __future__ import annotations

import pytest
import torch

from megatrain.planner.costs import memory_model
from megatrain.planner.shapes import model_shapes
from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan

transformers = pytest.importorskip("transformers")

from hf_reference import assert_matches_transformers, batch  # noqa: E402
from test_gpt_oss import _hf_model  # noqa: E402

STEPS = 3


def _starved_model():
    """transformers' gpt-oss (4 experts, 2 a token) whose last expert no token chooses."""
    config, hf = _hf_model()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.router.bias[-1] = -100.0
    return config, hf


def _train(hf, config, plan: Plan):
    optimizer = OptimizerConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0)
    with Engine(ModelConfig.from_hf(config.to_dict()), optimizer, plan=plan, compute_dtype=torch.float32,
                device="cpu") as engine:
        engine.load_state_dict(hf.state_dict())
        losses = []
        for step in range(STEPS):
            ids, labels = batch(config.vocab_size, seed=step)
            losses.append(engine.step(ids, labels).item())
        engine.synchronize()
        tokens = None if engine.routing is None else engine.routing.tokens.clone()
        return losses, engine.state_dict(), engine.executor.slots.buffers[0].numel(), tokens


@pytest.mark.parametrize("group", [1, 3])
def test_gpt_oss_in_expert_groups_trains_as_the_whole_layer(group: int) -> None:
    config, hf = _starved_model()
    base = Plan(micro_batch_size=2, loss_chunk_tokens=16)
    whole = _train(hf, config, base)
    grouped = _train(hf, config, base.replace(expert_group_size=group))
    assert grouped[0][0] == whole[0][0], "the first step's forward is the whole layer's, bit for bit"
    assert grouped[0] == pytest.approx(whole[0], abs=1e-6)
    for name, w in whole[1].items():
        torch.testing.assert_close(grouped[1][name], w, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    shape = model_shapes.from_config(config.to_dict(), "tiny-gpt-oss")
    assert grouped[2] == memory_model.slot_numel(shape, base.replace(expert_group_size=group))[0] < shape.numel_layer


def test_gpt_oss_in_expert_groups_trains_as_transformers() -> None:
    config, hf = _starved_model()
    experts = hf.model.layers[0].mlp.experts
    starved = {n: getattr(experts, n)[-1].detach().clone() for n in ("down_proj", "gate_up_proj_bias")}
    assert_matches_transformers(config.vocab_size, hf, ModelConfig.from_hf(config.to_dict()), steps=STEPS,
                                plan=Plan(micro_batch_size=2, loss_chunk_tokens=16, expert_group_size=2))
    decay = (1 - 1e-3 * 0.1) ** STEPS  # hf_reference's lr and weight decay: no gradient, decayed all the same
    for name, before in starved.items():
        torch.testing.assert_close(getattr(experts, name)[-1].detach(), before * decay)


def test_gpt_oss_in_expert_groups_with_the_balance_loss_trains_as_the_whole_layer() -> None:
    config, hf = _hf_model(output_router_logits=True, router_aux_loss_coef=0.3)
    base = Plan(micro_batch_size=2, loss_chunk_tokens=16)
    whole = _train(hf, config, base)
    grouped = _train(hf, config, base.replace(expert_group_size=1))
    assert grouped[0][0] == whole[0][0], "the first step's forward is the whole layer's, bit for bit"
    assert grouped[0] == pytest.approx(whole[0], abs=1e-6)
    for name, w in whole[1].items():
        torch.testing.assert_close(grouped[1][name], w, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert whole[3] is not None and torch.equal(grouped[3], whole[3])
    config.router_aux_loss_coef = 0.0
    off = _train(hf, config, base.replace(expert_group_size=1))
    assert off[0][1] != grouped[0][1], "the loss's gradient changes the second step"
