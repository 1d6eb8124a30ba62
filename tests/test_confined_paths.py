"""Paths read from files stay inside their directory: a model's shard index (``weight_map``) and a checkpoint
manifest naming an absolute path, a ``..`` that climbs out, or a symlink out are refused in one line naming the
entry, before any byte of the file outside is read. A Hugging Face cache snapshot's links into its blobs/ load."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from megatrain.runtime import Engine, InputError
from megatrain.runtime.paths import confined

from test_checkpoint import engine, train
from test_hf_io import _hf_dir, _load, _one_line

pytest.importorskip("transformers")


def _rewrite_index(path, rename) -> str:
    """Point every weight_map entry of the index's second shard at ``rename(shard)``; the new name."""
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    new = rename(victim)
    index["weight_map"] = {k: (new if v == victim else v) for k, v in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    return new


def test_an_index_naming_a_shard_outside_the_model_is_refused(tmp_path) -> None:
    path, _ = _hf_dir(tmp_path, "qwen2", tied=False)
    (tmp_path / "outside").mkdir()

    def move_out(victim: str) -> str:
        shutil.move(path / victim, tmp_path / "outside" / "x.safetensors")  # a complete, loadable shard
        return "../outside/x.safetensors"
    new = _rewrite_index(path, move_out)
    with pytest.raises(InputError) as err:
        _load(path)
    line = _one_line(err)
    assert "'../outside/x.safetensors'" in line and "leads outside" in line and "model.safetensors.index.json" in line


def test_an_index_naming_an_absolute_path_is_refused_before_opening_it(tmp_path, monkeypatch) -> None:
    path, _ = _hf_dir(tmp_path, "qwen2", tied=False)
    _rewrite_index(path, lambda victim: "/etc/passwd")
    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: opened.append(os.fspath(f)) or real_open(f, *a, **k))
    with pytest.raises(InputError) as err:
        _load(path)
    line = _one_line(err)
    assert "'/etc/passwd'" in line and "not a relative path" in line
    assert "/etc/passwd" not in opened


def test_a_shard_symlinked_out_of_the_model_is_refused(tmp_path) -> None:
    path, _ = _hf_dir(tmp_path, "qwen2", tied=False)
    victim = _rewrite_index(path, lambda victim: victim)
    (tmp_path / "elsewhere").mkdir()
    shutil.move(path / victim, tmp_path / "elsewhere" / victim)
    os.symlink(tmp_path / "elsewhere" / victim, path / victim)
    with pytest.raises(InputError) as err:
        _load(path)
    assert f"'{victim}'" in _one_line(err) and "leads outside" in _one_line(err)
    os.remove(path / victim)  # the same shard in the folder: it loads
    shutil.move(tmp_path / "elsewhere" / victim, path / victim)
    _load(path).close()


def test_a_hub_cache_snapshots_links_into_its_blobs_are_allowed(tmp_path) -> None:
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_bytes(b"weights")
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    os.symlink(os.path.join("..", "..", "blobs", "abc123"), snapshot / "model.safetensors")
    assert confined(str(snapshot), "model.safetensors", "index") == str(snapshot / "model.safetensors")
    (tmp_path / "secret").write_text("not a model")
    os.symlink(tmp_path / "secret", snapshot / "other.safetensors")  # out of the repository's blobs/: refused
    with pytest.raises(InputError, match="'other.safetensors'"):
        confined(str(snapshot), "other.safetensors", "index")
    for bad in ("", None, 5, "a/../../x", "a\0b"):
        with pytest.raises(InputError):
            confined(str(snapshot), bad, "index")


def _saved(tmp_path) -> str:
    e = engine()
    train(e, 0, 2)
    e.save_checkpoint(str(tmp_path / "ckpt")).wait()
    e.close()
    return str(tmp_path / "ckpt" / "step-00000002")


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_checkpoint_manifest_naming_an_array_outside_its_step_is_refused(tmp_path, where) -> None:
    step = _saved(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(os.path.join(step, "master"), outside / "master")  # the whole array, readable where it now is
    new = "../../outside/master" if where == "relative" else str(outside / "master")
    manifest_file = os.path.join(step, "manifest.json")
    with open(manifest_file) as f:
        manifest = json.load(f)
    manifest["arrays"]["master"]["path"] = new
    manifest["files"] = {(new + rel[len("master"):] if rel.startswith("master/") else rel): size
                         for rel, size in manifest["files"].items()}
    with open(manifest_file, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(InputError) as err:
        Engine.load_checkpoint(step, device="cpu")
    line = str(err.value)
    assert "\n" not in line and "manifest.json" in line and repr(new) in line
