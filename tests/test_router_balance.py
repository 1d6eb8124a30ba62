"""The routers' load-balancing loss and per-expert token counts against transformers 5.

A tiny Mixtral, Qwen3-MoE, Qwen2-MoE and gpt-oss (whose router's logits carry its bias) saved by transformers
with ``output_router_logits: true`` trains 3 fp32 AdamW steps with clipping: each step's loss (cross-entropy +
coef x aux) and aux loss equal transformers' ``outputs.loss`` and ``outputs.aux_loss`` of one forward over the
whole batch, and the final weights equal transformers' model under ``torch.optim.AdamW``, whatever
micro-batches, sequence tiles and expert groups the plan runs (the statistics cover the whole batch:
[Note: router balance]). The per-expert counts equal those computed from transformers' router logits. A large
coefficient makes the loss's gradient show in the weights (without it they differ: checked).
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_reference import batch, randomize_norms_and_biases  # noqa: E402
from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan  # noqa: E402
from megatrain.runtime.errors import ConfigError  # noqa: E402
from numerics import assert_update_close  # noqa: E402
from test_families import MOE, TINY  # noqa: E402
from test_gpt_oss import _hf_model as _gpt_oss  # noqa: E402

SPARSE = (*MOE, "gpt_oss")  # every family with a router

OPTIMIZER = OptimizerConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)


def _saved(tmp_path, model_type: str, **extra):
    """transformers' model (fp32, random norms) and the directory it saved itself to."""
    if model_type == "gpt_oss":
        model = _gpt_oss(**extra)[1]  # random sinks too, GptOssExperts' own loop
    else:
        torch.manual_seed(7)
        config = transformers.AutoConfig.for_model(model_type, **{**TINY, **MOE[model_type], **extra})
        model = getattr(transformers, type(config).__name__.replace("Config", "ForCausalLM"))(config).float()
        randomize_norms_and_biases(model)
    model.save_pretrained(tmp_path / "hf")
    return model


def _counts(router_logits: tuple[torch.Tensor, ...], experts: int, top_k: int) -> torch.Tensor:
    """[layers, E]: the tokens each layer routes to each expert, from transformers' router logits."""
    rows = []
    for z in router_logits:
        chosen = torch.topk(torch.softmax(z, dim=-1, dtype=torch.float32), top_k, dim=-1).indices
        rows.append(torch.bincount(chosen.flatten(), minlength=experts))
    return torch.stack(rows)


def _train_both(hf, tmp_path, plan: Plan, steps: int = 3):
    """``steps`` steps of megatrain and of transformers (whole batch, AdamW, clipping) from the same weights;
    asserts the losses, aux losses and counts step by step, returns (ours, theirs, initial) weights."""
    config = hf.config
    engine = Engine(ModelConfig.from_hf(tmp_path / "hf"), OPTIMIZER, plan=plan, compute_dtype=torch.float32,
                    device="cpu")
    try:
        engine.load_state_dict(hf.state_dict())
        initial = {n: p.detach().clone() for n, p in hf.named_parameters()}
        optimizer = torch.optim.AdamW(hf.parameters(), lr=OPTIMIZER.lr, betas=OPTIMIZER.betas, eps=OPTIMIZER.eps,
                                      weight_decay=OPTIMIZER.weight_decay)
        for step in range(steps):
            ids, labels = batch(config.vocab_size, seed=step)
            out = hf(ids, labels=labels)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), OPTIMIZER.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
            loss = engine.step(ids, labels)
            routing = engine.routing
            assert abs(loss.item() - out.loss.item()) <= 1e-5, (step, loss.item(), out.loss.item())
            assert abs(routing.aux_loss.item() - out.aux_loss.item()) <= 1e-6, step
            experts = getattr(config, "num_local_experts", None) or config.num_experts  # Mixtral, gpt-oss: local
            expected = _counts(out.router_logits, experts, config.num_experts_per_tok)
            assert torch.equal(routing.tokens, expected), step
        theirs = {n: p.detach() for n, p in hf.named_parameters()}
        ours = engine.state_dict()
        return {n: ours[n] for n in theirs}, theirs, initial
    finally:
        engine.close()


# Per family: one row per micro-batch; 3 rows with attention and MLP tiles of 8 tokens; gpt-oss and Qwen3-MoE
# also in expert groups of one (test_expert_groups.py compares the others' groups with the whole layer).
PLANS = ([(t, 1, None, None) for t in SPARSE] + [(t, 3, 8, None) for t in SPARSE]
         + [(t, 3, 8, 1) for t in ("qwen3_moe", "gpt_oss")])


@pytest.mark.parametrize("model_type, micro, tile, group", PLANS,
                         ids=[f"{t}-micro{m}" + (f"-tiles{s}" if s else "") + (f"-groups{g}" if g else "")
                              for t, m, s, g in PLANS])
def test_aux_loss_trains_like_transformers(tmp_path, model_type: str, micro: int, tile: int | None,
                                           group: int | None) -> None:
    hf = _saved(tmp_path, model_type, output_router_logits=True, router_aux_loss_coef=0.3)
    assert ModelConfig.from_hf(tmp_path / "hf").router_aux_loss_coef == 0.3
    plan = Plan(micro_batch_size=micro, loss_chunk_tokens=16, attention_tile_tokens=tile, mlp_tile_tokens=tile,
                expert_group_size=group)
    ours, theirs, initial = _train_both(hf, tmp_path, plan)
    assert_update_close(ours, theirs, initial)


def test_without_the_loss_gradient_the_weights_differ(tmp_path, monkeypatch) -> None:
    """The test above can fail: without the aux loss's gradient in the backward, the training moves off."""
    import contextlib

    from megatrain.runtime.pipeline.experts.router_balance import RouterBalance

    monkeypatch.setattr(RouterBalance, "backward", lambda self: contextlib.nullcontext())
    hf = _saved(tmp_path, "qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.3)
    with pytest.raises(AssertionError):  # the second step's loss already differs
        assert_update_close(*_train_both(hf, tmp_path, Plan(micro_batch_size=1, loss_chunk_tokens=16)))


def test_counts_without_the_loss_and_evaluation_with_it(tmp_path) -> None:
    """output_router_logits false: counts still reported, no aux, the loss is the cross-entropy alone. With it
    on, ``evaluate`` reports transformers' eval loss (cross-entropy + coef x aux) and the config is exported."""
    hf = _saved(tmp_path, "qwen2_moe")
    with Engine.from_pretrained(tmp_path / "hf", OPTIMIZER, compute_dtype=torch.float32, device="cpu") as engine:
        assert engine.routing is None
        ids, labels = batch(hf.config.vocab_size)
        out = hf(ids, labels=labels, output_router_logits=True)
        loss = engine.step(ids, labels)
        assert engine.routing.aux_loss is None
        assert abs(loss.item() - (out.loss - 0.001 * out.aux_loss).item()) <= 1e-5  # HF adds it when asked
        assert torch.equal(engine.routing.tokens, _counts(out.router_logits, 4, 2))

    hf = _saved(tmp_path, "mixtral", output_router_logits=True, router_aux_loss_coef=0.02)
    with Engine.from_pretrained(tmp_path / "hf", OPTIMIZER, compute_dtype=torch.float32, device="cpu") as engine:
        ids, labels = batch(hf.config.vocab_size, seed=3)
        with torch.no_grad():
            expected = hf(ids, labels=labels).loss.item()
        assert abs(engine.evaluate(ids, labels).item() - expected) <= 1e-5
        engine.save_pretrained(tmp_path / "out", dtype=torch.float32)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["output_router_logits"] is True and written["router_aux_loss_coef"] == 0.02
    back = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert back.output_router_logits and back.router_aux_loss_coef == 0.02


@pytest.mark.parametrize("fields, words", [
    ({"output_router_logits": True, "router_aux_loss_coef": -1.0}, "router_aux_loss_coef=-1.0"),
    ({"output_router_logits": True, "router_aux_loss_coef": "0.1"}, "router_aux_loss_coef"),
])
def test_a_bad_coefficient_is_refused_in_one_line(fields: dict, words: str) -> None:
    data = {**transformers.AutoConfig.for_model("qwen3_moe", **{**TINY, **MOE["qwen3_moe"]}).to_dict(), **fields}
    with pytest.raises(ConfigError, match=words) as err:
        ModelConfig.from_hf(data)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="dense model") as err:
        ModelConfig(**{k: v for k, v in TINY.items() if k != "sliding_window"}, router_aux_loss_coef=0.01)
    assert "\n" not in str(err.value)


def _moe_ranks(rank: int, world: int) -> dict:
    """A tiny Qwen3-MoE with the loss on, 2 steps over rank ``rank``'s rows of a global batch of 4."""
    config = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True, model_type="qwen3_moe",
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                         router_aux_loss_coef=0.3)
    gen = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 61, (4, 12), generator=gen) for _ in range(2)]
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    with Engine(config, OPTIMIZER, plan=Plan(micro_batch_size=1), compute_dtype=torch.float32, device="cpu",
                seed=3) as engine:
        initial = engine.state_dict()
        out: dict = {"losses": [], "aux": [], "tokens": []}
        for ids in data:
            out["losses"].append(engine.step(ids[rows], ids[rows]).item())
            out["aux"].append(engine.routing.aux_loss.item())
            out["tokens"].append(engine.routing.tokens.clone())
        return {**out, "initial": initial, "final": engine.state_dict()}


def test_data_parallel_ranks_balance_over_the_global_batch(tmp_path) -> None:
    """2 gloo ranks: counts, aux and loss over the global batch, as one process; the same weights after."""
    from rank_processes import run_ranks

    single = _moe_ranks(0, 1)
    for got in run_ranks(_moe_ranks, 2, tmp_path):
        for a, b in zip(got["losses"] + got["aux"], single["losses"] + single["aux"]):
            assert abs(a - b) <= 1e-6 * abs(b)
        assert all(torch.equal(a, b) for a, b in zip(got["tokens"], single["tokens"]))
        assert_update_close(got["final"], single["final"], single["initial"])


def test_a_step_of_micro_batches_is_one_forward_not_a_trainers_accumulation(tmp_path) -> None:
    """What a step of 3 one-row micro-batches equals: transformers' loss of the 3 rows in one forward. The HF
    Trainer accumulating over the same micro-batches (``num_items_in_batch``, losses summed) adds each one's
    coef x aux instead, 3 aux terms: megatrain's loss does not depend on the plan's micro-batches."""
    hf = _saved(tmp_path, "qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.3)
    ids, labels = batch(hf.config.vocab_size)
    n_items = int((labels[:, 1:] != -100).sum())
    with torch.no_grad():
        whole = hf(ids, labels=labels).loss.item()
        accumulated = sum(hf(ids[r:r + 1], labels=labels[r:r + 1], num_items_in_batch=n_items).loss.item()
                          for r in range(3))
    with Engine.from_pretrained(tmp_path / "hf", OPTIMIZER, plan=Plan(micro_batch_size=1),
                                compute_dtype=torch.float32, device="cpu") as engine:
        loss = engine.step(ids, labels).item()
    assert abs(loss - whole) <= 1e-5 and accumulated - whole > 0.3  # two more aux terms of ~2 x 0.3
