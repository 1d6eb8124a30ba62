"""Training megatrain against transformers' own model on the same weights (shared by test_hf_parity,
test_families, test_moe and test_gpt_oss).

``assert_matches_transformers``: logits within 1e-5 in float32, then a few steps of megatrain against the
transformers model trained by ``torch.optim.AdamW`` with ``clip_grad_norm_``, losses within 1e-5 each step and
the parameters within float32 noise after them (``numerics.assert_update_close``; sources of difference:
transformers' attention kernel and its loss reduction differ in summation order from megatrain's).
"""
from __future__ import annotations

from pathlib import Path

import torch

from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan
from numerics import assert_update_close


def randomize_norms_and_biases(model: torch.nn.Module) -> None:
    """Random norms and biases too (transformers initialises them to 1 and 0), so that a misplaced one shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))


def batch(vocab: int, rows: int = 3, seq: int = 20, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [rows, seq] and labels with a quarter of the positions ignored (-100)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=gen)
    labels = ids.clone()
    labels[torch.rand(rows, seq, generator=gen) < 0.25] = -100
    return ids, labels


def assert_matches_transformers(vocab_size: int, hf: torch.nn.Module, mt_config: ModelConfig, steps: int = 3,
                                plan: Plan | None = None) -> None:
    """``plan``: megatrain's (default: one row per micro-batch, loss chunks of 16 tokens)."""
    optimizer = OptimizerConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.0)
    engine = Engine(mt_config, optimizer, plan=plan or Plan(micro_batch_size=1, loss_chunk_tokens=16),
                    compute_dtype=torch.float32, device="cpu")
    try:
        engine.load_state_dict(hf.state_dict())
        ids, labels = batch(vocab_size)

        with torch.no_grad():
            expected_logits = hf(ids).logits
        torch.testing.assert_close(engine.logits(ids), expected_logits, rtol=0, atol=1e-5)

        initial = {n: p.detach().clone() for n, p in hf.named_parameters()}
        hf_opt = torch.optim.AdamW(hf.parameters(), lr=optimizer.lr, betas=optimizer.betas, eps=optimizer.eps,
                                   weight_decay=optimizer.weight_decay)
        for step in range(steps):
            ids, labels = batch(vocab_size, seed=step)
            n_items = int((labels[:, 1:] != -100).sum())
            hf_loss = 0.0
            for row in range(ids.shape[0]):  # the same micro-batches, HF's loss summed over the batch's items
                out = hf(ids[row:row + 1], labels=labels[row:row + 1], num_items_in_batch=n_items)
                out.loss.backward()
                hf_loss += out.loss.item()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), optimizer.max_grad_norm)
            hf_opt.step()
            hf_opt.zero_grad()
            loss = engine.step(ids, labels).item()
            assert abs(loss - hf_loss) <= 1e-5, (step, loss, hf_loss)

        ours = engine.state_dict()
        theirs = {n: p.detach() for n, p in hf.named_parameters()}
        assert_update_close({n: ours[n] for n in theirs}, theirs, initial)
    finally:
        engine.close()


def assert_saved_trains_and_exports(directory: Path, hf: torch.nn.Module, out: Path) -> None:
    """The model transformers saved in ``directory`` (``hf`` itself, untrained) loads with
    ``Engine.from_pretrained`` with the same weights, trains 3 steps as ``hf`` trains (``assert_matches_transformers``
    on the config read from the directory; ``hf`` is trained by it), and its export to ``out`` loads back in
    transformers with the weights that were saved."""
    with Engine.from_pretrained(directory, compute_dtype=torch.float32, device="cpu") as engine:
        loaded = engine.state_dict()
        engine.save_pretrained(out, dtype=torch.float32)
    for name, p in hf.named_parameters():
        assert torch.equal(loaded[name], p.detach()), name

    assert_matches_transformers(hf.config.vocab_size, hf, ModelConfig.from_hf(directory), steps=3)

    import transformers  # the callers skip without it

    saved = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(exported) is type(saved)
    theirs = dict(exported.named_parameters())
    assert sorted(theirs) == sorted(n for n, _ in saved.named_parameters())
    for name, p in saved.named_parameters():
        assert torch.equal(theirs[name], p), name


def assert_packed_documents_match_transformers(hf: torch.nn.Module, mt_config: ModelConfig, ids: torch.Tensor,
                                               lengths: list[list[int]]) -> None:
    """megatrain's logits for rows of packed documents (``lengths`` per row, positions restarting at each) equal
    transformers' for each document run alone."""
    positions = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    with Engine(mt_config, compute_dtype=torch.float32, device="cpu") as engine:
        engine.load_state_dict(hf.state_dict())
        logits = engine.logits(ids, position_ids=positions)
    with torch.no_grad():
        for r, row in enumerate(lengths):
            start = 0
            for n in row:
                alone = hf(ids[r:r + 1, start:start + n]).logits[0]
                torch.testing.assert_close(logits[r, start:start + n], alone, rtol=0, atol=1e-5)
                start += n
