"""Optimizer state on the device ([Note: resident blocks] in runtime/state/resident_state.py): a plan's resident
blocks keep their fp32 master, m, v and gradient in device memory and are updated there by torch's fused AdamW.
On a CPU device that is the same kernel on the same fp32 views as the CPU AdamW's, so the losses, weights and
AdamW state must be the host path's bits: with clipping (deferred) and without (eager and deferred), across a
checkpoint, and with the plans that cannot hold such blocks refused in one line."""
from __future__ import annotations

import pytest
import torch

from megatrain.plan.plan import Plan, PlanError
from megatrain.runtime import Engine, ModelConfig, OptimizerConfig
from megatrain.runtime.errors import ConfigError

CONFIG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=True, qk_norm=True)
UNTIED = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, tie_word_embeddings=False)
HOST = Plan(micro_batch_size=2, kept_layers=(1,), num_slots=3, prefetch_depth=2)


def _batches(config: ModelConfig, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, config.vocab_size, (4, 12), generator=gen) for _ in range(steps)]


def _train(plan: Plan, clip: float | None, config: ModelConfig = CONFIG, steps: int = 3, engine_out: list | None = None,
           skip: bool = False) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """Losses, weights and AdamW state after ``steps`` fp32 steps (``skip``: skip_nonfinite, on finite steps)."""
    with Engine(config, OptimizerConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=clip, skip_nonfinite=skip), plan=plan,
                compute_dtype=torch.float32, device="cpu", seed=3) as engine:
        losses = [engine.step(ids, ids).item() for ids in _batches(config, steps)]
        if engine_out is not None:
            engine_out.append(engine.store)
        return losses, engine.state_dict(), engine.optimizer_state_dict()


def _same(a: tuple, b: tuple) -> None:
    assert a[0] == b[0]
    assert all(torch.equal(a[1][k], v) for k, v in b[1].items())
    for name, state in b[2].items():
        assert all(torch.equal(a[2][name][k], v) for k, v in state.items()), name


@pytest.mark.parametrize("mode,clip,thread", [("deferred", 0.05, "compute"), ("deferred", None, "worker"),
                                              ("eager", None, "worker"), ("deferred", 0.05, "worker")])
def test_resident_blocks_train_the_host_paths_bits(mode: str, clip: float | None, thread: str) -> None:
    """Some blocks resident (the tied embedding, a layer, the head) and every block resident: the same losses,
    weights, m, v and step counts as every block in host RAM (clip 0.05 clips every step here)."""
    host = HOST.replace(optimizer_mode=mode, adam_thread=thread)
    expected = _train(host, clip)
    for resident in ((0, 2, 4), (0, 1, 2, 3, 4)):
        stores: list = []
        _same(_train(host.replace(resident_blocks=resident), clip, engine_out=stores), expected)


def test_resident_blocks_of_an_untied_model_train_the_host_paths_bits() -> None:
    host = HOST.replace(kept_layers=())
    _same(_train(host.replace(resident_blocks=(0, 3)), 0.05, UNTIED), _train(host, 0.05, UNTIED))
    # skip_nonfinite's check on the device (the kernel's found_inf, the step count kept) changes no finite step's bits
    for clip, mode in ((0.05, "deferred"), (None, "eager")):
        plan = host.replace(optimizer_mode=mode)
        _same(_train(plan.replace(resident_blocks=(0, 1, 3)), clip, UNTIED, skip=True), _train(plan, clip, UNTIED))


def test_resident_state_is_on_the_device_and_not_in_host_ram() -> None:
    """The host arenas hold only the blocks not resident; the device state holds 16 bytes per resident parameter
    and the gradient buffers are sized by the host blocks alone."""
    with Engine(UNTIED, OptimizerConfig(max_grad_norm=1.0), plan=HOST.replace(kept_layers=(), resident_blocks=(1, 2)),
                compute_dtype=torch.float32, device="cpu") as engine:
        store, blocks = engine.store, engine.templates.blocks
        on_device = blocks[1].layout.numel + blocks[2].layout.numel
        host = sum(b.layout.numel for b in blocks) - on_device
        assert store.resident is not None and store.resident.nbytes == 16 * on_device
        assert store.master.tensor.numel() == store.exp_avg.tensor.numel() == store.grads.tensor.numel() == host
        assert store.exp_avg_sq.tensor.numel() == host
        g = engine.executor.grad_buffers.buffers[0].numel()
        assert g == max(blocks[0].layout.numel, blocks[3].layout.numel)


@pytest.mark.parametrize("mode", ["deferred", "eager"])
def test_the_breakdown_times_the_device_adamw(monkeypatch, mode: str) -> None:
    """``device_adam_busy_s`` is the device AdamW's update time in the timed step: every fused AdamW call slowed
    by 20 ms, every block resident (so every call is the device AdamW's), it holds at least the sleeps of the
    timed step's calls; none is timed in an untimed step, and with no block resident it is 0."""
    import time

    calls: list[int] = []
    fused = torch._fused_adamw_

    def slow(*args, **kwargs):
        calls.append(1)
        time.sleep(0.02)
        return fused(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", slow)
    ids = _batches(UNTIED, 1)[0]
    for resident in ((0, 1, 2, 3), ()):
        plan = HOST.replace(kept_layers=(), optimizer_mode=mode, resident_blocks=resident)
        with Engine(UNTIED, OptimizerConfig(max_grad_norm=1.0 if mode == "deferred" else None), plan=plan,
                    compute_dtype=torch.float32, device="cpu") as engine:
            engine.step(ids, ids)
            engine.synchronize()
            calls.clear()
            engine.time_next_step()
            engine.step(ids, ids)
            engine.synchronize()
            b = engine.last_step_breakdown
            assert b is not None
            if resident:
                assert b["device_adam_busy_s"] >= 0.02 * len(calls) > 0
                assert b["roofline_s"] >= b["device_adam_busy_s"]
            else:
                assert b["device_adam_busy_s"] == 0.0


def test_resident_blocks_resume_bitwise(tmp_path) -> None:
    """Two steps, a checkpoint, two more (in the same process, and resumed in a fresh engine): the bits of four
    steps straight through, and a resident checkpoint resumes into a host plan and back."""
    plan = HOST.replace(resident_blocks=(0, 1, 3))
    opt = OptimizerConfig(lr=1e-2, max_grad_norm=0.05)
    batches = _batches(CONFIG, 4)

    def run(p: Plan, resume: str | None, ids: list[torch.Tensor], save: str | None = None) -> dict:
        engine = (Engine.load_checkpoint(resume, plan=p, device="cpu") if resume else
                  Engine(CONFIG, opt, plan=p, compute_dtype=torch.float32, device="cpu", seed=3))
        with engine:
            for x in ids:
                engine.step(x, x)
            if save:  # a snapshot (the resident blocks gathered into it), written behind
                handle = engine.save_checkpoint(save)
                engine.step(ids[0], ids[0])  # training goes on while it is written: the snapshot's bits are saved
                handle.wait()
                return {}
            return {**engine.state_dict(), **{f"{k}.v": s["exp_avg_sq"] for k, s in engine.optimizer_state_dict().items()}}

    straight = run(plan, None, batches)
    run(plan, None, batches[:2], save=str(tmp_path / "ck"))
    for p in (plan, HOST):
        resumed = run(p, str(tmp_path / "ck"), batches[2:])
        assert all(torch.equal(resumed[k], v) for k, v in straight.items())


def test_plans_that_cannot_keep_blocks_on_the_device_are_refused() -> None:
    with pytest.raises(PlanError, match="resident_blocks=.*twice"):
        Plan(resident_blocks=(1, 1))
    with pytest.raises(PlanError, match="spill='all'"):
        Plan(resident_blocks=(1,), spill="all", spill_dir="/tmp")
    with pytest.raises(PlanError, match="compute_in_place"):
        Plan(resident_blocks=(1,), compute_in_place=True)
    with pytest.raises(PlanError, match="names block 9"):
        Engine(CONFIG, plan=HOST.replace(resident_blocks=(9,)), compute_dtype=torch.float32, device="cpu")
    with pytest.raises(ConfigError, match="bf16 AdamW state"):  # (stochastic rounding on the device: not built)
        Engine(CONFIG, OptimizerConfig(state_dtype="bf16"), plan=HOST.replace(resident_blocks=(1,)),
               compute_dtype=torch.float32, device="cpu")
    assert "resident_blocks" not in Plan().to_json() and Plan.from_json(Plan(resident_blocks=(2, 0)).to_json()) == \
        Plan(resident_blocks=(0, 2))


def _rank_train(rank: int, world: int, clip: float | None, mode: str, save: str) -> list:
    """One rank's losses and final weights and AdamW state, with a host plan and a resident one; the resident run
    saves a checkpoint mid-way, a third resumes it into a host plan: every rank's bits of the same run."""
    rows = slice(rank * 4 // world, (rank + 1) * 4 // world)
    out = []
    for plan in (HOST.replace(optimizer_mode=mode), HOST.replace(optimizer_mode=mode, resident_blocks=(0, 2, 4))):
        with Engine(CONFIG, OptimizerConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=clip), plan=plan,
                    compute_dtype=torch.float32, device="cpu", seed=3) as engine:
            losses = []
            for i, ids in enumerate(_batches(CONFIG, 3)):
                losses.append(engine.step(ids[rows], ids[rows]).item())
                if i == 1 and plan.resident_blocks:
                    engine.save_checkpoint(save, blocking=True)
            out.append((losses, engine.state_dict(), engine.optimizer_state_dict()))
    with Engine.load_checkpoint(save, plan=HOST.replace(optimizer_mode=mode), device="cpu") as engine:
        ids = _batches(CONFIG, 3)[2]
        engine.step(ids[rows], ids[rows])
        out.append(([], engine.state_dict(), engine.optimizer_state_dict()))
    return out


@pytest.mark.parametrize("mode,clip", [("deferred", 0.05), ("eager", None)])
def test_resident_blocks_sharded_over_two_ranks_train_the_host_paths_bits(tmp_path, mode: str,
                                                                            clip: float | None) -> None:
    """Two gloo ranks, each block's state sharded: a rank's resident shards train the bits of its host shards,
    and a checkpoint the resident ranks wrote resumes into host ranks with the same bits."""
    from rank_processes import run_ranks
    for host, resident, resumed in run_ranks(_rank_train, 2, tmp_path, clip, mode, str(tmp_path / "ck")):
        _same(resident, host)
        assert all(torch.equal(resumed[1][k], v) for k, v in host[1].items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode,clip", [("deferred", 0.05), ("eager", None), ("deferred", None)])
def test_resident_blocks_on_cuda_train_as_the_host_path(mode: str, clip: float | None) -> None:
    """On a GPU the resident blocks' update is CUDA's fused AdamW on the optim stream, the host blocks' the CPU's:
    the same losses within 1e-6 relative and the weights within the update-relative noise bound (the two kernels
    round differently), every block resident and some; the state is read back to the host for state dicts."""
    from numerics import assert_update_close
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        def run(plan: Plan) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
            with Engine(CONFIG, OptimizerConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=clip), plan=plan,
                        compute_dtype=torch.float32, device="cuda", seed=3) as engine:
                initial = engine.state_dict()
                losses = [engine.step(ids.cuda(), ids.cuda()).item() for ids in _batches(CONFIG, 3)]
                return losses, initial, engine.state_dict()
        host = HOST.replace(optimizer_mode=mode)
        losses, initial, expected = run(host)
        for resident in ((0, 2, 4), (0, 1, 2, 3, 4)):
            got_losses, _, got = run(host.replace(resident_blocks=resident))
            assert got_losses == pytest.approx(losses, rel=1e-6)
            assert all(t.device.type == "cpu" for t in got.values())
            assert_update_close(got, expected, initial)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
