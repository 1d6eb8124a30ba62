"""Engine.evaluate: the loss a step would report, streamed and chunked like a step's forward, and nothing of the
training state changes (weights, AdamW state, step count, random state, the training that follows)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2)
TIED = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
PLANS = {
    "one micro-batch": Plan(micro_batch_size=4),
    "micro-batches, loss chunks, host checkpoints": Plan(micro_batch_size=1, loss_chunk_tokens=7,
                                                         checkpoints="host", num_slots=3, prefetch_depth=2),
    "eager": Plan(micro_batch_size=2, optimizer_mode="eager", loss_chunk_tokens=5),
}


def batches(n: int, batch: int = 4, seq: int = 12, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (batch, seq), generator=gen)
        labels = ids.clone()
        labels[0, :5] = -100  # a masked prompt
        out.append((ids, labels))
    return out


def engine(config: ModelConfig, plan: Plan, dtype: torch.dtype = torch.float32) -> Engine:
    clip = None if plan.optimizer_mode == "eager" else 1.0
    return Engine(config, OptimizerConfig(lr=3e-3, max_grad_norm=clip), plan=plan, compute_dtype=dtype,
                  device="cpu", seed=7)


@pytest.mark.parametrize("config", [CONFIG, TIED], ids=["untied", "tied"])
@pytest.mark.parametrize("name", list(PLANS))
def test_evaluate_is_bitwise_the_loss_the_step_reports(config, name):
    data = batches(4)
    with engine(config, PLANS[name]) as e:
        for ids, labels in data:  # before each step (with the previous step's deferred update in flight)
            evaluated = e.evaluate(ids, labels)
            stepped = e.step(ids, labels)
            assert evaluated.dtype == torch.float32 and evaluated.dim() == 0
            assert torch.equal(evaluated, stepped), (evaluated.item(), stepped.item())


def test_evaluate_is_bitwise_the_step_loss_in_bf16_too():
    with engine(TIED, PLANS["micro-batches, loss chunks, host checkpoints"], torch.bfloat16) as e:
        for ids, labels in batches(3):
            evaluated = e.evaluate(ids, labels)
            assert torch.equal(evaluated, e.step(ids, labels))


@pytest.mark.parametrize("name", list(PLANS))
def test_training_after_evaluations_is_bitwise_training_without_them(name):
    data, held_out = batches(4), batches(2, batch=3, seq=10, seed=1)
    with engine(TIED, PLANS[name]) as plain, engine(TIED, PLANS[name]) as evaluated:
        plain_losses = [plain.step(ids, labels).item() for ids, labels in data]
        losses = []
        for ids, labels in data:
            rng = torch.get_rng_state()
            for h_ids, h_labels in held_out:
                evaluated.evaluate(h_ids, h_labels)
            assert torch.equal(torch.get_rng_state(), rng)
            assert evaluated.step_count == len(losses)
            losses.append(evaluated.step(ids, labels).item())
            evaluated.evaluate(*held_out[0])
        assert losses == plain_losses and evaluated.step_count == plain.step_count == len(data)
        a, b = plain.state_dict(), evaluated.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
        oa, ob = plain.optimizer_state_dict(), evaluated.optimizer_state_dict()
        assert all(torch.equal(oa[k][s], ob[k][s]) for k in oa for s in ("exp_avg", "exp_avg_sq", "step"))


def test_evaluate_matches_plain_pytorch_on_the_same_weights():
    ids, labels = batches(1, batch=3, seq=16)[0]
    with engine(CONFIG, PLANS["micro-batches, loss chunks, host checkpoints"]) as e:
        e.step(ids, labels)
        loss = e.evaluate(ids, labels).item()
        logits = e.logits(ids)  # the materialised reference path
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    expected = F.cross_entropy(logits.reshape(-1, 64), shifted.reshape(-1), ignore_index=-100).item()
    assert loss == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_evaluate_matches_transformers_on_the_same_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.save_pretrained(tmp_path)
    ids, labels = batches(1, batch=2, seq=16)[0]
    with torch.no_grad():
        expected = model(input_ids=ids, labels=labels).loss.item()
    with Engine.from_pretrained(tmp_path, plan=Plan(micro_batch_size=1, loss_chunk_tokens=6),
                                compute_dtype=torch.float32, device="cpu") as e:
        assert e.evaluate(ids, labels).item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_evaluate_never_materialises_the_full_logits(monkeypatch):
    config = ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # no other projection is 97 wide
    ids, labels = batches(1, batch=2, seq=16)[0]
    chunk, rows = 5, []
    linear = F.linear

    def recording(x, weight, *args):
        out = linear(x, weight, *args)
        if out.shape[-1] == config.vocab_size:
            rows.append(out.reshape(-1, out.shape[-1]).shape[0])
        return out

    with engine(config, Plan(micro_batch_size=2, loss_chunk_tokens=chunk)) as e:
        monkeypatch.setattr(F, "linear", recording)
        e.evaluate(ids, labels)
    assert rows and max(rows) <= chunk and sum(rows) == ids.numel()


def test_evaluate_refuses_bad_input_like_step():
    from megatrain.runtime import MegatrainError

    with engine(CONFIG, PLANS["one micro-batch"]) as e:
        ids = torch.randint(0, 64, (2, 8))
        with pytest.raises(MegatrainError, match="labels has shape"):
            e.evaluate(ids, ids[:, :4])
        with pytest.raises(MegatrainError, match="no token to predict"):
            e.evaluate(ids, torch.full_like(ids, -100))
        assert e.step_count == 0
