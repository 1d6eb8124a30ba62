"""bf16 AdamW m and v in spill files ([Note: bf16 optimizer state], [Note: spill]): the same bits as bf16 state in
RAM, files of 2 bytes per element that are the planner's disk bytes, exact resume, and the planner's figures."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from megatrain.planner.costs import memory_model, spill_placement, spill_timing, step_traffic
from megatrain.planner.shapes import model_shapes
from megatrain.planner.choice import search, spill_choices
from megatrain.plan.buffer_kinds import WIDEN_ELEMENTS, BufferKind
from megatrain.planner.profiling.hardware import GiB, HardwareProfile
from megatrain.planner.shapes.workload import Workload
from megatrain.runtime import ConfigError, Engine, ModelConfig, OptimizerConfig, Plan
from megatrain.tools import train as train_cli

# The embedding (8200 x 128) and the untied head are each just over WIDEN_ELEMENTS: with 4 MiB chunks they are
# read, updated, rounded and written in two chunks, the second one at an offset inside the block.
CONFIG = ModelConfig(vocab_size=8200, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
KINDS = (BufferKind.MASTER, BufferKind.EXP_AVG, BufferKind.EXP_AVG_SQ)
CHUNK = 4 * WIDEN_ELEMENTS
RAM = Plan(micro_batch_size=2, loss_chunk_tokens=16)
# For the planner: every block of this shape is a multiple of 2048 elements, so no 4 KiB rounding tells fp32 state's
# files from bf16's.
SHAPE = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 2,
         "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000, "tie_word_embeddings": False}


def spilled(spill: str, spill_dir: str, **more) -> Plan:
    return RAM.replace(spill=spill, spill_dir=spill_dir, spill_chunk_bytes=CHUNK, spill_staging=2, **more)


def optimizer(state_dtype: str = "bf16", clip: float | None = 0.5) -> OptimizerConfig:
    return OptimizerConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=clip, no_decay=("norm",),
                           state_dtype=state_dtype)


def engine(plan: Plan, state_dtype: str = "bf16") -> Engine:
    """Clipping (deferred updates), or none in eager mode."""
    clip = 0.5 if plan.optimizer_mode == "deferred" else None
    return Engine(CONFIG, optimizer(state_dtype, clip), plan=plan, compute_dtype=torch.float32, device="cpu", seed=5)


def train(e: Engine, start: int, stop: int) -> None:
    for s in range(start, stop):
        ids = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(100 + s))
        e.step(ids, ids, lr=1e-2 / (1 + 0.1 * s))


def bits(e: Engine) -> dict[str, torch.Tensor]:
    """Every block's master, m and v as bytes (read from RAM or from the spill files alike), and the step counts."""
    e.synchronize()
    s = e.store
    out = {str(k): torch.cat([s.read_block(k, b).view(torch.uint8) for b in range(len(s.numels))]) for k in KINDS}
    out["steps"] = torch.stack(s.steps).view(torch.uint8)
    return out


def assert_same(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


# Per block: m of the embedding and a layer, v of the head on disk, the rest in RAM (a block's m and v apart).
MIXED = {"master": [1], "exp_avg": [0, 2], "exp_avg_sq": [3], "grads": [0]}


@pytest.mark.parametrize("spill, more", [("optimizer", {}), ("all", {}), ("blocks", {"spill_blocks": MIXED}),
                                         ("optimizer", {"optimizer_mode": "eager"})],
                         ids=["optimizer", "all", "blocks", "optimizer-eager"])
def test_spilled_bf16_state_equals_bf16_state_in_ram(spill: str, more: dict, tmp_path) -> None:
    plan = spilled(spill, str(tmp_path), **more)
    with engine(RAM.replace(optimizer_mode=plan.optimizer_mode)) as e:
        train(e, 0, 3)
        expected = bits(e)
    with engine(plan) as e:
        store = e.store
        assert store.is_spilled(BufferKind.EXP_AVG, 0) and store.is_spilled(BufferKind.EXP_AVG_SQ, 3)
        assert len(store.disk.chunks(0)) == 2 and store.disk.chunks(0)[1][0] == WIDEN_ELEMENTS
        assert store.read_block(BufferKind.EXP_AVG, 0).dtype == torch.bfloat16
        assert all(t.dtype == torch.bfloat16 for s in store.staging._sets for k, t in s.items()
                   if k in (BufferKind.EXP_AVG, BufferKind.EXP_AVG_SQ))
        train(e, 0, 3)
        got = bits(e)
        assert got["exp_avg"].numel() == 2 * store.total_numel  # 2 bytes per element
    assert_same(expected, got)


def test_spill_files_are_the_planners_disk_bytes(tmp_path) -> None:
    """Each kind's file on disk is the memory model's term for it; bf16 m and v take 2 bytes per element (each block
    rounded up to 4 KiB), the fp32 master and grads 4."""
    shape = model_shapes.from_config(CONFIG.to_dict())
    sizes = {}
    for state in ("fp32", "bf16"):
        plan = spilled("all", str(tmp_path))
        work = Workload(seq_len=16, batch=2, compute_dtype="fp32", optimizer_state=state)
        est = {c.name: c.nbytes for c in memory_model.estimate(shape, work, plan).components if c.where == "nvme"}
        with engine(plan, state) as e:
            root, numels = e.store.spill_root, e.store.numels
            sizes[state] = {k: os.path.getsize(os.path.join(root, f"{k}.bin")) for k in BufferKind}
            assert sum(est.values()) == e.store.nvme_bytes == sum(sizes[state].values())
            assert est["Adam m (spill file)"] == sizes[state][BufferKind.EXP_AVG]
            assert est["Adam v (spill file)"] == sizes[state][BufferKind.EXP_AVG_SQ]
            assert est["fp32 master (spill file)"] == sizes[state][BufferKind.MASTER]
            assert est["fp32 grads (spill file)"] == sizes[state][BufferKind.GRADS]
    fp32, bf16 = sizes["fp32"], sizes["bf16"]
    for kind in (BufferKind.EXP_AVG, BufferKind.EXP_AVG_SQ):
        assert fp32[kind] == sum(-(-n * 4 // 4096) * 4096 for n in numels)
        assert bf16[kind] == sum(-(-n * 2 // 4096) * 4096 for n in numels)
        assert 0 <= 2 * bf16[kind] - fp32[kind] < 4096 * len(numels)  # half, but for each block's 4 KiB rounding
    assert (bf16[BufferKind.MASTER], bf16[BufferKind.GRADS]) == (fp32[BufferKind.MASTER], fp32[BufferKind.GRADS])


def test_spilled_bf16_state_resumes_bitwise(tmp_path) -> None:
    """A checkpoint saved with m and v on disk, resumed (on disk, and in RAM), gives the bits of a run never
    interrupted; its arrays are byte for byte those a run with bf16 state in RAM saves."""
    with engine(RAM) as e:
        train(e, 0, 4)
        expected = bits(e)
    with engine(RAM) as e:
        train(e, 0, 2)
        e.save_checkpoint(tmp_path / "ram", blocking=True)
    with engine(spilled("optimizer", str(tmp_path))) as e:
        train(e, 0, 2)
        e.save_checkpoint(tmp_path / "disk", blocking=True)
        train(e, 2, 4)
        assert_same(expected, bits(e))
    manifests = [json.loads((tmp_path / d / "step-00000002" / "manifest.json").read_text()) for d in ("ram", "disk")]
    for name in ("master", "exp_avg", "exp_avg_sq"):
        ram, disk = (m["arrays"][name] for m in manifests)
        assert ram["dtype"] == disk["dtype"] == ("float32" if name == "master" else "bfloat16")
        assert ram["crc32"] == disk["crc32"], name
    for plan in (None, RAM):  # the saved plan (m and v on disk), and the same checkpoint into RAM
        with Engine.load_checkpoint(tmp_path / "disk", plan=plan) as resumed:
            assert resumed.store.is_spilled(BufferKind.EXP_AVG, 0) == (plan is None)
            train(resumed, 2, 4)
            assert_same(expected, bits(resumed))


def test_planner_counts_2_bytes_of_m_and_v_on_disk() -> None:
    """With m and v spilled, bf16 state's files are 2 + 2 bytes per parameter, fp32's 4 + 4, and so are a step's
    disk reads and writes, AdamW's disk time and what a staging set reads ahead (by hand)."""
    shape = model_shapes.from_config(SHAPE)
    assert all(n % 2048 == 0 for n in (shape.numel_embedding, shape.numel_layer, shape.numel_head))
    N, plan = shape.numel_total, Plan(spill="optimizer", spill_dir="/spill")
    for state, s in (("fp32", 4), ("bf16", 2)):
        work = Workload(seq_len=512, batch=2, compute_dtype="bf16", spill="optimizer", spill_dir="/spill",
                        optimizer_state=state)
        assert memory_model.estimate(shape, work, plan).nvme_bytes == 2 * s * N
        assert step_traffic.disk_traffic(shape, work, plan) == (2 * s * N, 2 * s * N)
        spilled = spill_placement.Spilled.of(shape, plan, work.state_bytes)
        assert spilled.block_disk_bytes(1) == 2 * s * shape.numel_layer
        chunk = spill_choices.spill_chunk_bytes(shape, work.state_bytes)
        first = spill_timing.read_ahead(spilled, chunk, 1, float("inf"))
        assert first[0] == 2 * s * min(chunk // 4, shape.numel_embedding) and sum(first[1:]) == 0


def test_megatrain_plan_size_needs_4_bytes_per_parameter_less_disk_with_bf16_state(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SHAPE))
    out = {}
    for state in ("fp32", "bf16"):
        r = subprocess.run([sys.executable, "-m", "megatrain.planner.commands.cli", "size", "--model", str(path),
                            "--seq-len", "512", "--batch", "2", "--spill", "optimizer", "--spill-dir", str(tmp_path),
                            "--optimizer-state", state, "--json"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out[state] = json.loads(r.stdout)
    params = model_shapes.from_config(SHAPE).numel_total
    assert out["fp32"]["nvme_bytes"] - out["bf16"]["nvme_bytes"] == 4 * params > 0


def test_bf16_spill_refuses_chunks_off_the_rounding_pieces(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"spill_chunk_bytes=8192 must be a multiple of 4194304 \(4 MiB\)"):
        engine(spilled("optimizer", str(tmp_path)).replace(spill_chunk_bytes=8192))
    assert not [t.name for t in threading.enumerate() if t.name.startswith("megatrain-io")]  # the refusal's I/O stopped
    # fp32 state, or bf16 state with only the master and grads on disk, take any chunk
    with engine(spilled("optimizer", str(tmp_path)).replace(spill_chunk_bytes=8192), "fp32"):
        pass
    masters = RAM.replace(spill="blocks", spill_dir=str(tmp_path), spill_chunk_bytes=8192,
                          spill_blocks={"master": [0, 1], "grads": [2]})
    with engine(masters) as e:
        assert e.store.exp_avg is not None and e.store.is_spilled(BufferKind.MASTER, 0)


def test_the_search_plans_bf16_spill_on_4_mib_chunks_and_the_plan_runs(tmp_path) -> None:
    """With bf16 state the search offers spill plans (auto fills RAM first) whose chunks are 4 MiB multiples (a
    layer of 12.5 MiB: 16 MiB chunks; fp32 state: the layer's bytes), charges each staging set its fp32 and bf16
    buffers, and such a plan runs with the disk bytes it was planned with."""
    hw = HardwareProfile(gpu_name="cpu", gpu_mem_bytes=0, h2d_gbps=5.0, d2h_gbps=5.0, duplex_gbps=5.0,
                         matmul_tflops={"float32": 0.2}, cpu_adam_params_per_s=1e9, host_ram_bytes=64 * GiB,
                         host_available_bytes=60 * GiB, cores=2, disk_read_gbps=1.0, disk_write_gbps=1.0)
    m = model_shapes.from_config(dict(model_type="llama", vocab_size=16384, hidden_size=512, intermediate_size=1536,
                                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                      tie_word_embeddings=True))
    chunk = spill_choices.spill_chunk_bytes
    assert chunk(m) == -(-m.numel_layer * 4 // 4096) * 4096 != chunk(m, 2)
    assert spill_choices.spill_chunk_bytes(m, 2) == 16 * 2**20
    assert Workload(256, 4, "fp32", spill_dir="/nvme", optimizer_state="bf16").spill_choices() == ("none", "all")
    best = search.search(m, Workload(256, 4, "fp32", spill="all", spill_dir="/nvme", optimizer_state="bf16"),
                         hw).require()
    assert best.plan.spill_chunk_bytes == 16 * 2**20
    staging = next(c for c in best.memory.components if c.name == "spill staging")
    assert staging.nbytes == best.plan.spill_staging * (2 * 4 + 2 * 2) * 2**22  # Ck = 4M elements: master, grads, m, v
    tiny = model_shapes.from_config(CONFIG.to_dict())
    work = Workload(16, 2, "fp32", spill="optimizer", spill_dir=str(tmp_path), optimizer_state="bf16")
    choice = search.search(tiny, work, hw).require()
    assert choice.plan.spill == "optimizer" and choice.plan.spill_chunk_bytes % (4 * 2**20) == 0
    with engine(Plan.from_json(choice.plan.to_json())) as e:
        train(e, 0, 1)
        assert e.store.nvme_bytes == choice.memory.nvme_bytes > 0


def test_megatrain_train_refuses_a_plan_whose_chunks_are_off_the_pieces_in_one_line(tmp_path, capsys) -> None:
    plan = tmp_path / "plan.json"
    Plan(spill="optimizer", spill_dir=str(tmp_path), spill_chunk_bytes=2**20).save(str(plan))
    code = train_cli.main(["--out", str(tmp_path / "run"), "--steps", "1", "--plan", str(plan), "--spill-dir",
                       str(tmp_path), "--optimizer-state", "bf16", "--seq-len", "32", "--batch", "2",
                       "--progress", "none", "--no-plot"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "spill_chunk_bytes=1048576 must be a multiple of 4194304 (4 MiB)" in err
