"""Memory model: each component against a hand computation, for Llama-3.1-8B and Qwen2.5-7B."""
from __future__ import annotations

from megatrain.planner.profiling import hardware
from megatrain.planner.costs import memory_model
from megatrain.planner.costs.memory_model import CUDA_CONTEXT_BYTES, HOST_PROCESS_BYTES
from megatrain.planner.shapes.model_shapes import PRESETS
from megatrain.plan.plan import Plan
from megatrain.planner.shapes.workload import Workload

H100 = hardware.preset("H100-SXM")


def _by_name(est: memory_model.MemoryEstimate) -> dict[tuple[str, str], int]:
    return {(c.where, c.name): c.nbytes for c in est.components}


def test_llama_8b_device_checkpoints_deferred_by_hand() -> None:
    m = PRESETS["shape:Llama-3.1-8B"]
    work = Workload(seq_len=4096, batch=8, compute_dtype="bf16")
    plan = Plan(num_slots=2, prefetch_depth=1, micro_batch_size=1, checkpoints="device",
                optimizer_mode="deferred", device_grad_buffers=2, loss_chunk_tokens=1024)
    est = memory_model.estimate(m, work, plan, H100)
    got = _by_name(est)
    bmax = 4096 + 128256 * 4096                      # head block: final norm + lm_head = 525,340,672
    T = 8 * 4096                                     # global batch tokens
    N = 8_030_261_248                                # every tensor is 64-aligned already
    per_token = (2 * (5 * 4096 + 3 * 4096 + 3 * 1024 + 4 * 14336)   # saved, bf16
                 + 8 * 4096 + 4 * 32                                  # fp32 norm inputs, logsumexp
                 + 2 * (3 * 14336 + 2 * 4096))                        # backward transients
    assert per_token == 321_664
    expected_device = {
        "weight slots": 2 * bmax * 2,                               # 2,101,362,688
        "grad accumulators": 2 * bmax * 4,                          # 4,202,725,376
        "activation checkpoints": 32 * T * 4096 * 2,                # 8 GiB
        "activation grad": T * 4096 * 2,
        "layer working set": 4096 * per_token + 218_112_000 * 2,    # t = 1 x 4096 tokens
        # one call of all 32 query and 8 kv heads: t x D x (gq x (c + 4) + 2 gk x c + 2 gq x c)
        "attention working set": 4096 * 128 * (32 * 6 + 2 * 8 * 2 + 2 * 32 * 2),
        "logits chunk": 1024 * 128256 * (2 + 12),
    }
    for name, nbytes in expected_device.items():
        assert got[("device", name)] == nbytes, name
    tensors = sum(expected_device.values())
    assert got[("device", "allocator slack")] == int(0.05 * tensors)
    assert got[("device", "CUDA context")] == CUDA_CONTEXT_BYTES
    assert est.device_bytes == tensors + int(0.05 * tensors) + CUDA_CONTEXT_BYTES
    # host: 4 master + 4 m + 4 v + 2 shadow + 4 grads = 18 bytes per parameter, plus the process
    assert est.host_bytes == 18 * N + HOST_PROCESS_BYTES
    # pinned: only what crosses PCIe, the bf16 shadow (host to GPU) and the grads (GPU to host); master, m and v
    # are read and written by AdamW on the CPU alone
    assert est.pinned_host_bytes == (2 + 4) * N
    pinned = {c.name for c in est.components if c.pinned}
    assert pinned == {"compute-dtype shadow", "fp32 grads (full arena)"}
    assert est.nvme_bytes == 0
    assert ("device", "tied embedding grad") not in got


def test_qwen_7b_host_checkpoints_eager_by_hand() -> None:
    m = PRESETS["shape:Qwen2.5-7B"]
    work = Workload(seq_len=1024, batch=16, compute_dtype="bf16", clipping=False)
    plan = Plan(num_slots=3, prefetch_depth=2, micro_batch_size=4, checkpoints="host", optimizer_mode="eager",
                host_grad_slabs=4, loss_chunk_tokens=8192)
    got = _by_name(memory_model.estimate(m, work, plan, H100))
    bmax = 3584 + 152064 * 3584                      # untied head block
    T, t = 16 * 1024, 4 * 1024
    N = 7_615_616_512
    assert got[("device", "weight slots")] == 3 * bmax * 2
    assert got[("device", "checkpoint staging")] == 2 * t * 3584 * 2        # two reload buffers of a micro-batch
    assert got[("device", "checkpoint drains in flight")] == T * 3584 * 2    # one drained input per micro-batch
    assert ("device", "activation checkpoints") not in got
    assert got[("device", "logits chunk")] == t * 152064 * 14               # chunk capped at t = 4096
    assert got[("host", "activation checkpoints")] == 28 * T * 3584 * 2
    assert got[("host", "fp32 grad slabs")] == 4 * bmax * 4                  # eager: S slabs, no full arena
    assert ("host", "fp32 grads (full arena)") not in got
    assert got[("host", "fp32 master")] == got[("host", "Adam m")] == got[("host", "Adam v")] == 4 * N
    assert got[("host", "compute-dtype shadow")] == 2 * N


def test_tied_fp32_and_cpu_device() -> None:
    m = PRESETS["shape:Llama-3.2-1B"]
    work = Workload(seq_len=512, batch=2, compute_dtype="fp32")
    cpu = hardware.HardwareProfile(gpu_name="cpu", gpu_mem_bytes=0, h2d_gbps=5, d2h_gbps=5, duplex_gbps=5,
                                   matmul_tflops={"float32": 0.1}, cpu_adam_params_per_s=1e9,
                                   host_ram_bytes=64 << 30, host_available_bytes=60 << 30, cores=2)
    est = memory_model.estimate(m, work, Plan(), cpu)
    got = _by_name(est)
    assert got[("device", "tied embedding grad")] == 128256 * 2048 * 4
    assert ("host", "compute-dtype shadow") not in got                      # fp32 compute aliases the master
    assert ("device", "CUDA context") not in got and ("device", "allocator slack") not in got
    assert est.pinned_host_bytes == 0                                        # no CUDA: nothing is pinned
    # no GPU: device buffers count against host RAM
    small = cpu.replace(host_ram_bytes=est.host_bytes + 1, host_available_bytes=est.host_bytes + 1)
    over = est.overruns(small)
    assert [o.budget for o in over] == ["host RAM"]
    assert over[0].needed == est.host_bytes + est.device_bytes


def test_pinned_in_fp32_is_the_master_that_travels_and_the_gradients() -> None:
    """fp32 compute: the master is the weights the loads copy, so it is pinned; m and v never are (eager: the slabs
    carry the gradients)."""
    m = PRESETS["shape:Qwen2.5-7B"]
    N, bmax = 7_615_616_512, 3584 + 152064 * 3584
    for mode, grads in (("deferred", 4 * N), ("eager", 2 * bmax * 4)):
        plan = Plan(optimizer_mode=mode, host_grad_slabs=2)
        work = Workload(seq_len=1024, batch=1, compute_dtype="fp32", clipping=mode == "deferred")
        est = memory_model.estimate(m, work, plan, H100)
        assert est.pinned_host_bytes == 4 * N + grads
        assert not any(c.pinned for c in est.components if c.name in ("Adam m", "Adam v"))


def test_tied_embeddings_gradient_accumulators_hold_a_layer_by_hand() -> None:
    """A tied embedding's gradient adds up in its own buffer and the head holds only its norm, so the device
    gradient accumulators are a layer's size (Bg), while the weight slots stay the table's (Bmax = E)."""
    work = Workload(seq_len=4096, batch=8, compute_dtype="bf16")
    plan = Plan(num_slots=2, device_grad_buffers=3, micro_batch_size=1, checkpoints="host")
    # Llama-3.2-3B: E = 128256 x 3072; a layer: q, o 3072^2, k, v 3072 x 1024, gate, up, down 3 x 3072 x 8192,
    # two norms; the head: the final norm. Gemma-3-27B: E = 262208 x 5376, a layer 412,898,560 (four norms more).
    for name, e, layer in (("shape:Llama-3.2-3B", 128256 * 3072,
                            2 * 3072 * 3072 + 2 * 3072 * 1024 + 3 * 3072 * 8192 + 2 * 3072),
                           ("shape:Gemma-3-27B", 262208 * 5376, 412_898_560)):
        got = _by_name(memory_model.estimate(PRESETS[name], work, plan, H100))
        assert got[("device", "weight slots")] == 2 * e * 2, name
        assert got[("device", "tied embedding grad")] == e * 4, name
        assert got[("device", "grad accumulators")] == 3 * layer * 4, name
    assert 3 * (128256 * 3072 - 100_669_440) * 4 == 3_519_995_904  # 3.5 GB less on the device at 3B
