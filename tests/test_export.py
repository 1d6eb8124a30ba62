"""megatrain-export (tools/export.py): a trained run becomes a directory transformers loads, tokenizer included;
an existing directory is never written into."""
from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch

from megatrain.runtime import Engine
from megatrain.tools import export, io_failure, train

from chat_model import train_two_steps, write_model, write_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    model = write_model(write_tokenizer(str(root / "model")), vocab_size=300)
    out = root / "run"
    train_two_steps(model, str(root), str(out))
    return root, model, out


def test_export_loads_in_transformers_and_generates(trained_run, capsys):
    root, model, run = trained_run
    out = root / "exported"
    assert export.main([str(run), str(out), "--dtype", "fp32"]) == 0
    names = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "generation_config.json"} <= names
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    assert hf.generation_config.eos_token_id == 2
    # The exported weights are the checkpoint's trained masters (not the starting model's).
    engine = Engine.load_checkpoint(os.path.join(run, "checkpoints"), device="cpu")
    try:
        reference = Engine.from_pretrained(out, device="cpu")
        try:
            trained, exported = engine.state_dict(), reference.state_dict()
            assert trained.keys() == exported.keys()
            for name in trained:
                torch.testing.assert_close(exported[name], trained[name], rtol=0, atol=0)
        finally:
            reference.close()
    finally:
        engine.close()
    start = transformers.AutoModelForCausalLM.from_pretrained(model)
    assert not torch.equal(start.lm_head.weight, hf.lm_head.weight)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    generated = hf.generate(**prompt, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 4
    assert isinstance(tok.decode(generated[0]), str)


def test_export_bf16_from_a_step_directory(trained_run):
    root, _, run = trained_run
    step = sorted(p for p in os.listdir(run / "checkpoints") if p.startswith("step-"))[-1]
    out = root / "bf16"
    out.mkdir()  # an empty directory is accepted
    assert export.main([str(run / "checkpoints" / step), str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert hf.lm_head.weight.dtype == torch.bfloat16


def test_an_existing_directory_is_refused_untouched(trained_run, tmp_path, capsys):
    _, _, run = trained_run
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    capsys.readouterr()
    assert export.main([str(run), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds" in err and "Traceback" not in err
    assert os.listdir(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"
    assert [n for n in os.listdir(tmp_path) if n != "mine"] == []  # no staging directory left behind


@pytest.mark.parametrize("argv, fragment", [
    (["missing-run", "x"], "does not exist"),
    (["RUN", "x", "--dtype", "fp8"], "invalid choice"),
    (["RUN"], "required"),
])
def test_bad_arguments_are_one_line(trained_run, tmp_path, capsys, argv, fragment):
    _, _, run = trained_run
    argv = [str(run) if a == "RUN" else a for a in argv]
    argv = [str(tmp_path / a) if a in ("x", "missing-run") else a for a in argv]
    capsys.readouterr()
    assert export.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and err.startswith("megatrain-export: error: ")
    assert not (tmp_path / "x").exists()


def test_a_run_that_spilled_exports_and_leaves_no_scratch_files(trained_run, tmp_path):
    root, model, _ = trained_run
    run = tmp_path / "spilled"
    assert train.main(["--model", model, "--data", str(root / "chat.jsonl"), "--out", str(run), "--seq-len", "32",
                       "--batch", "2", "--steps", "1", "--progress", "none", "--no-plot", "--spill", "optimizer",
                       "--compute-dtype", "fp32"]) == 0
    exports = tmp_path / "exports"
    exports.mkdir()
    assert export.main([str(run), str(exports / "model"), "--dtype", "fp32"]) == 0
    assert os.listdir(exports) == ["model"]  # the checkpoint's spill files went to a scratch directory, removed
    hf = transformers.AutoModelForCausalLM.from_pretrained(exports / "model")
    assert transformers.AutoTokenizer.from_pretrained(exports / "model").eos_token == "<|im_end|>"
    assert hf.config.vocab_size == 300


def test_a_killed_exports_folders_are_removed_by_the_next_export_and_others_kept(trained_run, tmp_path, capsys):
    _, _, run = trained_run
    exports = tmp_path / "exports"
    exports.mkdir()
    killed = ("import os, shutil; from megatrain.tools import export; "
              "shutil.copyfile = lambda *a: os._exit(9); "  # killed once the weights are written, with the tokenizer
              f"export.main([{str(run)!r}, {str(exports / 'first')!r}, '--dtype', 'fp32'])")
    assert subprocess.run([sys.executable, "-c", killed]).returncode == 9
    (left,) = os.listdir(exports)
    assert left.startswith(".first.export-")
    mine = exports / ".notes.export-draft"  # named alike, not megatrain's: kept
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert export.main([str(run), str(exports / "second"), "--dtype", "fp32"]) == 0
    assert sorted(os.listdir(exports)) == [".notes.export-draft", "second"]
    assert (mine / "notes.txt").read_text() == "mine"
    assert f"removed 1 folder(s) left in {exports} by exports that no longer run: {left}" in capsys.readouterr().err


def test_an_export_gets_the_users_umask(trained_run, tmp_path):
    _, _, run = trained_run
    previous = os.umask(0o027)
    try:
        assert export.main([str(run), str(tmp_path / "shared"), "--dtype", "fp32"]) == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(tmp_path / "shared").st_mode) == 0o750
    assert stat.S_IMODE(os.stat(tmp_path / "shared" / "config.json").st_mode) == 0o640


def test_a_full_disk_during_an_export_is_its_own_status(trained_run, tmp_path, monkeypatch, capsys):
    _, _, run = trained_run

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "x" / "tokenizer.json"))
    monkeypatch.setattr(shutil, "copyfile", full)
    assert export.main([str(run), str(tmp_path / "x"), "--dtype", "fp32"]) == io_failure.EXIT_IO
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokenizer.json: No space left on device" in err, err
    assert os.listdir(tmp_path) == []  # the staging folder removed, OUT never made
