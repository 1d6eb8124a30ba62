"""--model org/name (tools/hub_models.py): a Hugging Face Hub name read from a cache laid out exactly as
huggingface_hub lays it out (models--org--name/{blobs,refs,snapshots/<commit>}), offline, with --revision."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from megatrain.tools import hub_models, train, train_config

pytest.importorskip("huggingface_hub")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from chat_model import RECORDS, write_model, write_tokenizer  # noqa: E402

REPO = "tiny-org/tiny-chat"
ARGS = ["--seq-len", "32", "--batch", "2", "--steps", "1", "--progress", "none", "--no-plot", "--warmup-steps", "1",
        "--compute-dtype", "fp32", "--device", "cpu"]


def hub_cache(home: str, repo: str, snapshots: dict[str, str]) -> dict[str, str]:
    """Lay ``snapshots`` (ref -> directory of files) out as huggingface_hub does under HF_HOME=``home``: each
    file once in blobs/ by content hash, each snapshot a folder of relative symlinks, each ref a commit.
    Returns ref -> commit."""
    root = os.path.join(home, "hub", "models--" + repo.replace("/", "--"))
    for sub in ("blobs", "refs", "snapshots"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    commits = {}
    for ref, directory in snapshots.items():
        commit = hashlib.sha1(ref.encode()).hexdigest()  # 40 hex digits, as a git commit
        folder = os.path.join(root, "snapshots", commit)
        os.makedirs(folder)
        for name in sorted(os.listdir(directory)):
            with open(os.path.join(directory, name), "rb") as f:
                content = f.read()
            blob = hashlib.sha256(content).hexdigest()
            with open(os.path.join(root, "blobs", blob), "wb") as f:
                f.write(content)
            os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(folder, name))
        with open(os.path.join(root, "refs", ref), "w") as f:
            f.write(commit)
        commits[ref] = commit
    return commits


def _second_model(directory: str) -> str:
    """The same tokenizer with a one-layer model: another parameter count, so the snapshot read is visible."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    write_tokenizer(directory)
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                 tie_word_embeddings=False)).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    base = tmp_path_factory.mktemp("hub")
    main = write_model(write_tokenizer(str(base / "main")), vocab_size=300)
    second = _second_model(str(base / "v2"))
    commits = hub_cache(str(base / "hf"), REPO, {"main": main, "v2": second})
    data = base / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in RECORDS * 4) + "\n")
    return base, commits, str(data)


def _run(base, argv, cwd):
    env = {**os.environ, "HF_HOME": str(base / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "megatrain.tools.train"] + argv, capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=600)


def _params(directory: str) -> int:
    from transformers import AutoModelForCausalLM

    return sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(directory).parameters())


def test_a_hub_name_trains_offline_from_the_cache_with_its_tokenizer_and_revision(cache, tmp_path):
    _check_runs(cache, tmp_path, (("main", []), ("v2", ["--revision", "v2"])))


@pytest.mark.slow
def test_a_revision_may_be_a_commit(cache, tmp_path):
    _check_runs(cache, tmp_path, (("v2", ["--revision", cache[1]["v2"]]),))


def _check_runs(cache, tmp_path, runs):
    base, commits, data = cache
    snapshots = base / "hf" / "hub" / ("models--" + REPO.replace("/", "--")) / "snapshots"
    for ref, revision in runs:
        out = tmp_path / f"run-{len(os.listdir(tmp_path))}"
        proc = _run(base, ["--model", REPO, "--data", data, "--out", str(out)] + revision + ARGS, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        summary = json.loads((out / "summary.json").read_text())
        snapshot = str(snapshots / commits[ref])
        assert summary["num_parameters"] == _params(snapshot)
        assert f"{REPO}{'@' + revision[1] if revision else ''}, Hugging Face cache (pretrained weights)" in proc.stderr
        recorded = json.loads((out / "run.json").read_text())  # the run keeps the name, not the cache's path
        assert recorded["model"] == REPO and recorded["revision"] == (revision[1] if revision else "")
        assert recorded["tokenizer"] == os.path.join(snapshot, "tokenizer.json")
    assert _params(str(snapshots / commits["main"])) != _params(str(snapshots / commits["v2"]))


def test_offline_and_not_cached_is_one_line_saying_how_to_fix_it(cache, tmp_path):
    base, _, data = cache
    for argv, words in ((["--model", "tiny-org/absent"], ("not in the Hugging Face cache", "HF_HUB_OFFLINE",
                                                          "hf download tiny-org/absent")),
                        (["--model", REPO, "--revision", "v9"], ("at revision v9", "HF_HUB_OFFLINE"))):
        proc = _run(base, argv + ["--data", data, "--out", str(tmp_path / "run")] + ARGS, cwd=tmp_path)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert all(w in lines[0] for w in words), lines[0]
        assert not (tmp_path / "run").exists()


def test_a_local_directory_of_the_same_name_wins(cache, tmp_path, monkeypatch, capsys):
    base, _, data = cache
    local = _second_model(str(tmp_path / REPO))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hub_models, "snapshot", lambda *a: pytest.fail("the Hub was asked for a local directory"))
    assert train.main(["--model", REPO, "--data", data, "--out", "run"] + ARGS) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["num_parameters"] == _params(local)
    assert f"{REPO} (pretrained weights)" in capsys.readouterr().err


def test_hub_names_as_paths_and_revision_options():
    assert hub_models.is_hub_name("Qwen/Qwen2.5-0.5B-Instruct") and not hub_models.is_hub_name("a/b/c")
    assert not hub_models.is_hub_name("models/config.json") and not hub_models.is_hub_name("demo")
    # A TOML file's relative paths are relative to the file, but a Hub name stays a name.
    assert train_config.relative_to("/somewhere", "model", "Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert train_config.relative_to("/somewhere", "model", "./local/model") == "/somewhere/./local/model"
    with pytest.raises(train_config.TrainConfigError, match="revision.*Hub name only"):
        train_config.TrainConfig(model="demo", revision="main")


def test_a_preset_bare_name_is_refused_naming_the_shape_and_the_hub(capsys):
    assert train.main(["--model", "qwen2.5-0.5b", "--steps", "1", "--progress", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model shape:Qwen2.5-0.5B" in err[0] and "Hugging Face Hub name (org/name)" in err[0]
