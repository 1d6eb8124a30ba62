"""Hugging Face interop: Engine.from_pretrained / save_pretrained against transformers.

Random tiny models of each family (tied and untied) are saved by transformers in
several shards, loaded by megatrain, trained a step, exported, and reloaded by
transformers: logits equal megatrain's. Broken directories (truncated or corrupt
safetensors, missing or misshapen tensors, a wrong config, an unsupported
architecture) raise one-line errors naming the problem. Peak RAM while loading
a model of several shards is measured in a subprocess.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from megatrain.runtime import ConfigError, Engine, InputError, ModelConfig, OptimizerConfig, Plan  # noqa: E402

from test_hf_parity import COMMON, FAMILIES  # noqa: E402  (the same tiny families)

PLAN = Plan(micro_batch_size=2, loss_chunk_tokens=16)
OPT = OptimizerConfig(lr=1e-2, weight_decay=0.1)


def _hf_dir(tmp_path, family: str, tied: bool, shard: str = "20KB"):
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](tied)).float()
    with torch.no_grad():  # random norms and biases, so that a misplaced one shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    path = tmp_path / "hf"
    model.save_pretrained(path, max_shard_size=shard)
    return path, model


def _ids(seed: int = 0, batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, COMMON["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


def _hf_logits(path, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_round_trip(tmp_path, family: str, tied: bool) -> None:
    path, hf = _hf_dir(tmp_path, family, tied)
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1  # several shards + index
    ids = _ids()
    with Engine.from_pretrained(path, optimizer=OPT, plan=PLAN, compute_dtype=torch.float32, device="cpu") as engine:
        with torch.no_grad():
            torch.testing.assert_close(engine.logits(ids), hf(ids).logits, rtol=0, atol=1e-5)
        engine.step(ids, ids)
        trained = engine.logits(ids)
        assert not torch.allclose(trained, hf(ids).logits, atol=1e-3)  # the step changed the weights

        engine.save_pretrained(tmp_path / "fp32", dtype=torch.float32, max_shard_bytes=10_000)
        assert (tmp_path / "fp32" / "model.safetensors.index.json").exists()
        torch.testing.assert_close(_hf_logits(tmp_path / "fp32", ids), trained, rtol=0, atol=1e-5)

        engine.save_pretrained(tmp_path / "bf16")  # one file, bf16, the original config.json kept
        assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
        names = set(load_file(tmp_path / "bf16" / "model.safetensors"))
        assert ("lm_head.weight" in names) == (not tied)
    # bf16 files read both ways agree: transformers and megatrain see the same rounded weights.
    with Engine.from_pretrained(tmp_path / "bf16", compute_dtype=torch.float32, device="cpu") as again:
        torch.testing.assert_close(_hf_logits(tmp_path / "bf16", ids), again.logits(ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_export_from_a_modelconfig_loads_in_transformers(tmp_path, model_type: str) -> None:
    config = ModelConfig(**COMMON, model_type=model_type, tie_word_embeddings=model_type == "qwen3",
                         attention_bias=model_type == "qwen2", qk_norm=model_type == "qwen3",
                         o_proj_bias=False if model_type == "qwen2" else None,
                         rope_scaling={"rope_type": "linear", "factor": 2.0} if model_type == "llama" else None)
    ids = _ids(3)
    with Engine(config, compute_dtype=torch.float32, device="cpu", seed=3) as engine:
        engine.save_pretrained(tmp_path, dtype=torch.float32)
        assert ModelConfig.from_hf(tmp_path) == config
        torch.testing.assert_close(_hf_logits(tmp_path, ids), engine.logits(ids), rtol=0, atol=1e-5)


def test_export_refuses_a_config_transformers_cannot_express(tmp_path) -> None:
    config = ModelConfig(**COMMON, model_type="mistral", attention_bias=True)
    with Engine(config, compute_dtype=torch.float32, device="cpu") as engine:
        with pytest.raises(ConfigError, match="attention_bias"):
            engine.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


# ---------------------------------------------------------------------- broken directories
def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def _llama_dir(tmp_path):
    path, _ = _hf_dir(tmp_path, "llama", tied=False, shard="1GB")
    return path, path / "model.safetensors"


def _load(path):
    return Engine.from_pretrained(path, compute_dtype=torch.float32, device="cpu")


def test_truncated_safetensors_is_named(tmp_path) -> None:
    path, file = _llama_dir(tmp_path)
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(InputError, match="truncated") as err:
        _load(path)
    assert "model.safetensors" in _one_line(err)
    with open(file, "r+b") as f:  # cut inside the header
        f.truncate(20)
    with pytest.raises(InputError, match="truncated"):
        _load(path)


def test_corrupt_header_is_named(tmp_path) -> None:
    path, file = _llama_dir(tmp_path)
    raw = bytearray(file.read_bytes())
    raw[8:16] = b"\xff" * 8  # the JSON header's first bytes
    file.write_bytes(bytes(raw))
    with pytest.raises(InputError, match="corrupt header") as err:
        _load(path)
    assert "model.safetensors" in _one_line(err)


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path) -> None:
    path, file = _llama_dir(tmp_path)
    tensors = load_file(file)
    gone = tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is in no safetensors file"):
        _load(path)
    save_file({**tensors, "model.layers.1.mlp.up_proj.weight": gone[:, :-1].contiguous()}, file,
              metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"up_proj\.weight has shape \(48, 31\), the config implies \(48, 32\)"):
        _load(path)
    save_file({**tensors, "model.layers.1.mlp.up_proj.weight": gone, "score.weight": gone.clone()}, file,
              metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"unexpected tensor score\.weight"):
        _load(path)
    save_file({**tensors, "model.layers.1.mlp.up_proj.weight": gone.to(torch.int32)}, file, metadata={"format": "pt"})
    with pytest.raises(InputError, match="dtype I32"):
        _load(path)


def test_wrong_config_and_unsupported_architecture(tmp_path) -> None:
    path, _ = _llama_dir(tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(InputError, match="config implies"):
        _load(path)
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type='gpt2' is not supported"):
        _load(path)
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"]}))
    with pytest.raises(ConfigError, match="not a causal language model"):
        _load(path)


def test_index_naming_a_missing_shard_and_pickle_only_dirs(tmp_path) -> None:
    path, _ = _hf_dir(tmp_path, "qwen2", tied=False)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    os.remove(path / victim)
    with pytest.raises(InputError, match=victim):
        _load(path)
    empty = tmp_path / "pickled"
    empty.mkdir()
    (empty / "config.json").write_text((path / "config.json").read_text())
    (empty / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(InputError, match="pickle"):
        _load(empty)


# ---------------------------------------------------------------------- peak RAM
PEAK_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import torch
    from megatrain.runtime import Engine, ModelConfig
    from megatrain.runtime.io import hf_io

    def rss():  # bytes resident now
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    def hwm():  # peak bytes resident since the start or the last reset_peak()
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

    def reset_peak():  # Linux >= 4.0: "5" resets VmHWM to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    # torch's one-off process set-up (thread pools, kernels) is not the loader's: pay it on a tiny engine first.
    Engine(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                       num_attention_heads=4), device="cpu").close()
    torch.isfinite(torch.ones(2**18).sum())  # the loader's finite check (a sum): its kernel's code paged in once
    seen = {}
    load_weights = hf_io.load_weights

    def measured_load(engine, files):  # the engine is built; from here on only the shards' tensors arrive
        seen["built_peak"] = hwm()
        reset_peak()
        seen["at_load"] = rss()
        load_weights(engine, files)
        seen["load_peak"] = hwm()

    hf_io.load_weights = measured_load
    reset_peak()  # (ru_maxrss would count the pre-exec pytest process: VmHWM does not)
    before = rss()
    engine = Engine.from_pretrained(sys.argv[1], compute_dtype=torch.bfloat16, device="cpu")
    peak = max(seen["built_peak"], hwm())
    big = engine.store.max_block_numel
    device_buffers = (engine.plan.num_slots * big * 2 + engine.plan.device_grad_buffers * big * 4)
    print(json.dumps({"before": before, "peak": peak, "store": engine.store.nbytes, "device_buffers": device_buffers,
                      **seen}))
""")


def test_peak_ram_while_loading_several_shards(tmp_path) -> None:
    config = ModelConfig(vocab_size=8192, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2)
    with Engine(config, compute_dtype=torch.float32, device="cpu") as engine:
        engine.save_pretrained(tmp_path, dtype=torch.bfloat16, max_shard_bytes=2 * 2**20)
    shards = [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]
    largest = max((tmp_path / f).stat().st_size for f in shards)
    assert len(shards) >= 4
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout.strip().splitlines()[-1])
    print("peak RAM (MiB):", {k: round(v / 2**20, 2) for k, v in m.items()}, "largest shard", largest / 2**20)
    # The bound: the host store plus one shard. On a CPU the engine's "device" slots and gradient
    # buffers are host memory too, and are counted separately.
    assert m["peak"] - m["before"] <= m["store"] + m["device_buffers"] + largest, m
    # Streaming itself: loading every shard into the built engine adds one tensor (the largest shard here is one
    # tensor, the embedding) plus allocator slack, not a copy of the model.
    assert m["load_peak"] - m["at_load"] <= largest + 2 * 2**20, m
