"""Packed rows with ``position_ids``: documents that do not see each other, checked against references.

- Hugging Face transformers on the separate documents (same weights, float32): a packed row's logits are
  each document's logits run alone, its loss the token-weighted mean of the documents' losses (within
  1e-6), and a few training steps on packed rows move the parameters as transformers trained on the
  documents one by one does (``numerics.assert_update_close``).
- transformers on the same packed batch with ``position_ids`` (its sdpa path detects packed sequences).
- ``causal_attention`` against a dense attention with an explicit block-diagonal causal mask, values and
  gradients, over random document lengths (hypothesis).
- Without boundaries nothing changes: position ids 0..S-1 in every row give the bits of a step without.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from megatrain.runtime import Engine, InputError, ModelConfig, OptimizerConfig, Plan
from megatrain.models.layers.attention import Documents, causal_attention
from numerics import assert_update_close

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, attention_bias=True)


def _hf_llama(tied: bool = False):
    torch.manual_seed(4321)
    config = transformers.LlamaConfig(**COMMON, tie_word_embeddings=tied)
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():  # random norms and biases, so that a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return config, model


def _packed(lengths_per_row: list[list[int]], vocab: int, seed: int = 0):
    """Rows of documents end to end: (ids, labels, position_ids, documents) with each document's first label -100
    (nothing before it in its document predicts it); documents[r] = row r's token id tensors."""
    gen = torch.Generator().manual_seed(seed)
    seq = sum(lengths_per_row[0])
    assert all(sum(row) == seq for row in lengths_per_row)
    ids = torch.randint(0, vocab, (len(lengths_per_row), seq), generator=gen)
    labels = ids.clone()
    positions = torch.zeros_like(ids)
    docs = []
    for r, row in enumerate(lengths_per_row):
        start, row_docs = 0, []
        for n in row:
            positions[r, start:start + n] = torch.arange(n)
            labels[r, start] = -100
            row_docs.append(ids[r, start:start + n])
            start += n
        docs.append(row_docs)
    return ids, labels, positions, docs


def _engine(config, hf, micro_batch_size: int = 1, checkpoints: str = "device") -> Engine:
    engine = Engine(ModelConfig.from_hf(config.to_dict()),
                    OptimizerConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0),
                    plan=Plan(micro_batch_size=micro_batch_size, loss_chunk_tokens=16, checkpoints=checkpoints),
                    compute_dtype=torch.float32, device="cpu")
    engine.load_state_dict(hf.state_dict())
    return engine


ROWS = [[7, 1, 12, 4], [24], [3, 3, 3, 3, 3, 9]]  # lengths of the documents in each row of 24 tokens


def test_packed_row_equals_its_documents_run_alone_in_transformers() -> None:
    config, hf = _hf_llama()
    ids, labels, positions, docs = _packed(ROWS, config.vocab_size)
    with _engine(config, hf) as engine, torch.no_grad():
        logits = engine.logits(ids, position_ids=positions)
        for r, row_docs in enumerate(docs):
            expected = torch.cat([hf(d[None]).logits[0] for d in row_docs])
            torch.testing.assert_close(logits[r], expected, rtol=0, atol=1e-5)
        # The row's loss: the documents' HF losses (each a mean over its len - 1 predictions), token-weighted.
        losses = [(hf(d[None], labels=d[None]).loss.double(), len(d) - 1) for row in docs for d in row if len(d) > 1]
        expected_loss = sum(loss * n for loss, n in losses) / sum(n for _, n in losses)
        loss = engine.step(ids, labels, position_ids=positions, lr=0.0).item()
    assert abs(loss - expected_loss.item()) <= 1e-6, (loss, expected_loss.item())
    # The check can fail: the same row without boundaries attends across documents, and its loss is off by
    # more than 100x the tolerance.
    with _engine(config, hf) as engine:
        assert abs(engine.step(ids, labels, lr=0.0).item() - expected_loss.item()) > 1e-4


def test_engine_matches_transformers_on_a_packed_batch_with_position_ids() -> None:
    config, hf = _hf_llama(tied=True)
    ids, labels, positions, _ = _packed(ROWS, config.vocab_size, seed=1)
    with _engine(config, hf) as engine, torch.no_grad():
        # use_cache=False: transformers detects packed rows from position_ids only without a KV cache.
        expected = hf(ids, position_ids=positions, use_cache=False)
        torch.testing.assert_close(engine.logits(ids, position_ids=positions), expected.logits, rtol=0, atol=1e-5)
        hf_loss = hf(ids, labels=labels, position_ids=positions, use_cache=False).loss.item()
        assert abs(engine.step(ids, labels, position_ids=positions, lr=0.0).item() - hf_loss) <= 1e-6


@pytest.mark.parametrize("micro_batch_size, checkpoints", [(1, "device"), (2, "host")])
def test_training_on_packed_rows_matches_transformers_on_the_documents(micro_batch_size: int,
                                                                       checkpoints: str) -> None:
    """Three steps: megatrain on packed rows against transformers fed the documents one by one, the loss summed
    over the batch's predicted tokens, clipped, AdamW (the bound of test_hf_parity)."""
    config, hf = _hf_llama()
    engine = _engine(config, hf, micro_batch_size, checkpoints)
    initial = {n: p.detach().clone() for n, p in hf.named_parameters()}
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    try:
        for step in range(3):
            ids, labels, positions, docs = _packed(ROWS, config.vocab_size, seed=10 + step)
            n_items = int((labels[:, 1:] != -100).sum())
            hf_loss = 0.0
            for d in (d for row in docs for d in row if len(d) > 1):
                out = hf(d[None], labels=d[None], num_items_in_batch=n_items)
                out.loss.backward()
                hf_loss += out.loss.item()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            loss = engine.step(ids, labels, position_ids=positions).item()
            assert abs(loss - hf_loss) <= 1e-6, (step, loss, hf_loss)
        ours = engine.state_dict()
        theirs = {n: p.detach() for n, p in hf.named_parameters()}
        assert_update_close({n: ours[n] for n in theirs}, theirs, initial)
    finally:
        engine.close()


def test_one_document_per_row_is_bitwise_the_step_without_position_ids() -> None:
    config, hf = _hf_llama()
    ids, labels, _, _ = _packed([[24]] * 3, config.vocab_size, seed=3)
    positions = torch.arange(24).expand(3, 24)
    results = []
    for pos in (None, positions):
        with _engine(config, hf, micro_batch_size=2) as engine:
            losses = [engine.step(ids, labels, position_ids=pos) for _ in range(2)]
            results.append((losses, engine.state_dict()))
    (a_losses, a), (b_losses, b) = results
    assert all(torch.equal(x, y) for x, y in zip(a_losses, b_losses))
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("bad, match", [
    (torch.ones(3, 24, dtype=torch.long), "row 0 has 1 at token 0"),
    (torch.arange(24).expand(3, 24).clone().index_fill_(1, torch.tensor([5]), 7), "row 0 has 7 at token 5"),
    (torch.arange(23).expand(3, 23), r"shape \(3, 23\)"),
    (torch.zeros(3, 24), "integer"),
])
def test_bad_position_ids_are_one_clear_error(bad: torch.Tensor, match: str) -> None:
    config, hf = _hf_llama()
    ids, labels, _, _ = _packed([[24]] * 3, config.vocab_size)
    with _engine(config, hf) as engine:
        with pytest.raises(InputError, match=match):
            engine.step(ids, labels, position_ids=bad)
        with pytest.raises(InputError, match=match):
            engine.logits(ids, position_ids=bad)
        assert engine.step_count == 0


def _masked_reference(q, k, v, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense attention with an explicit mask: t sees s <= t of its own document (float64)."""
    doc = (positions == 0).cumsum(-1)  # [B, S] document number within the row
    s = q.shape[2]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    mask = causal & (doc[:, :, None] == doc[:, None, :])  # [B, S, S]
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask[:, None], -math.inf)
    return (scores.softmax(-1) @ v.double()).to(q.dtype)


@st.composite
def packed_rows(draw):
    seq = draw(st.integers(1, 24))
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        cuts = sorted(draw(st.sets(st.integers(1, seq - 1), max_size=6))) if seq > 1 else []
        bounds = [0, *cuts, seq]
        rows.append([b - a for a, b in zip(bounds, bounds[1:])])
    kv = draw(st.integers(1, 2))
    return rows, kv, kv * draw(st.integers(1, 3)), draw(st.sampled_from([4, 8]))


@settings(max_examples=40, deadline=None)
@given(case=packed_rows())
def test_attention_stays_within_documents_for_random_lengths(case) -> None:
    rows, kv_heads, heads, dim = case
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
    b, s = positions.shape
    documents = Documents.from_position_ids(positions)
    if all(len(row) == 1 for row in rows):
        assert documents is None  # one document per row: attention over the whole row
    else:
        assert documents.count == sum(len(row) for row in rows)
        assert [[n for _, n in row] for row in documents.spans] == rows
    gen = torch.Generator().manual_seed(b * 1000 + s)
    q = torch.randn(b, heads, s, dim, generator=gen, requires_grad=True)
    k = torch.randn(b, kv_heads, s, dim, generator=gen, requires_grad=True)
    v = torch.randn(b, kv_heads, s, dim, generator=gen, requires_grad=True)
    out = causal_attention(q, k, v, scale=dim ** -0.5, documents=documents)
    expected = _masked_reference(q, k, v, positions, dim ** -0.5)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    dy = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, (q, k, v), dy)
    expected_grads = torch.autograd.grad(expected, (q, k, v), dy)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_engine():
    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
    with Engine(config, plan=Plan(micro_batch_size=2), compute_dtype=torch.float32, device="cpu", seed=7) as engine:
        yield engine


@settings(max_examples=15, deadline=None)
@given(case=packed_rows(), seed=st.integers(0, 2**16))
def test_a_packed_row_is_its_documents_alone_for_random_lengths(tiny_engine, case, seed) -> None:
    """The engine's logits of packed rows against its own logits of each document as a row of its own, and the
    packed step's loss against the documents' losses combined by their token counts (1e-6 relative)."""
    rows = case[0]
    ids, labels, positions, docs = _packed(rows, 64, seed=seed)
    packed = tiny_engine.logits(ids, position_ids=positions)
    total, count = 0.0, 0
    for r, row_docs in enumerate(docs):
        alone = torch.cat([tiny_engine.logits(d[None])[0] for d in row_docs])
        torch.testing.assert_close(packed[r], alone, rtol=0, atol=1e-5)
        for d, logits in zip(row_docs, torch.split(alone, [len(d) for d in row_docs])):
            if len(d) > 1:
                total += torch.nn.functional.cross_entropy(logits[:-1].double(), d[1:], reduction="sum").item()
                count += len(d) - 1
    if count:  # lr=0: the step leaves the weights as they are
        loss = tiny_engine.step(ids, labels, position_ids=positions, lr=0.0).item()
        # fp32 against a float64 reference: 1e-6 relative (a few fp32 ULPs of the loss; 2.2 ULPs seen at 4.95)
        assert abs(loss - total / count) <= 1e-6 * max(1.0, total / count), (loss, total / count)
