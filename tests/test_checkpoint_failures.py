"""A failed checkpoint write is reported once and stops nothing; re-saving a step never leaves it unloadable.

See [Note: failed checkpoint writes] and [Note: checkpoint commit protocol] in runtime/io/training_checkpoint.py.
The re-save test kills a writer (SIGKILL) just before each rename of the protocol in turn.
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

from megatrain.runtime import CheckpointError, Engine, MegatrainError, ModelConfig, OptimizerConfig
from megatrain.runtime.io import checkpoint_format
from megatrain.runtime.io import checkpoint_directory

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2)
DISK_FULL = ValueError('RESOURCE_EXHAUSTED: Error writing local file "c/0": No space left on device [OS error: 28]')


def make_engine() -> Engine:
    return Engine(CONFIG, OptimizerConfig(lr=1e-3), compute_dtype=torch.float32, device="cpu", seed=3)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(step))
    return ids, ids


def weights(engine: Engine) -> dict[str, torch.Tensor]:
    return engine.state_dict()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _fail_writes(monkeypatch) -> None:
    def full(arr, t):
        raise DISK_FULL
    monkeypatch.setattr(checkpoint_format, "write_array", full)


def test_failed_save_is_raised_once_and_later_saves_work(tmp_path, monkeypatch) -> None:
    with make_engine() as engine:
        engine.step(*batch(0))
        engine.save_checkpoint(tmp_path, blocking=True)
        first = weights(engine)
        engine.step(*batch(1))
        _fail_writes(monkeypatch)
        handle = engine.save_checkpoint(tmp_path)  # in the background
        with pytest.raises(CheckpointError) as err:
            handle.wait()
        msg, need = str(err.value), 3 * 4 * engine.num_parameters  # master, exp_avg, exp_avg_sq in fp32
        assert "\n" not in msg and "disk is full" in msg and str(tmp_path) in msg, msg
        assert f"needs {need / 2**20:.1f} MiB" in msg, msg
        assert engine.wait_for_checkpoint() is None  # reported once, not again
        assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000001"], "a failed write left files behind"
        with pytest.raises(CheckpointError, match="disk is full"):  # blocking: raised to the caller at once
            engine.save_checkpoint(tmp_path, blocking=True)
        with Engine.load_checkpoint(tmp_path) as previous:  # the previous checkpoint is untouched
            assert previous.step_count == 1 and same(weights(previous), first)
        monkeypatch.undo()
        for blocking in (True, False):  # the cause is gone: both kinds of save work again
            engine.step(*batch(2 + blocking))
            handle = engine.save_checkpoint(tmp_path, blocking=blocking)
            assert handle.wait() == str(tmp_path / f"step-{engine.step_count:08d}")
            with Engine.load_checkpoint(tmp_path) as resumed:
                assert resumed.step_count == engine.step_count and same(weights(resumed), weights(engine))


def test_disk_full_counts_the_bytes_of_bf16_state(tmp_path, monkeypatch) -> None:
    """With bf16 m and v the checkpoint holds 4 + 2 + 2 bytes a parameter, and the disk-full line says so."""
    config = dataclasses.replace(CONFIG, vocab_size=1024, hidden_size=64)  # ~160k parameters: 8 and 12 bytes
    optimizer = OptimizerConfig(lr=1e-3, state_dtype="bf16")               # a parameter 0.6 MiB apart
    with Engine(config, optimizer, compute_dtype=torch.float32, device="cpu", seed=3) as engine:
        engine.step(*batch(0))
        _fail_writes(monkeypatch)
        with pytest.raises(CheckpointError) as err:
            engine.save_checkpoint(tmp_path, blocking=True)
        need = (4 + 2 + 2) * engine.num_parameters / 2**20  # fp32 master, bf16 exp_avg and exp_avg_sq, MiB
        said = re.search(r"needs ([0-9.]+) MiB", str(err.value))
        assert said and abs(float(said.group(1)) - need) < 0.1, (str(err.value), need)  # within arena padding


def test_unwaited_failure_is_warned_by_the_next_save_which_goes_ahead(tmp_path, monkeypatch) -> None:
    with make_engine() as engine:
        engine.step(*batch(0))
        _fail_writes(monkeypatch)
        handle = engine.save_checkpoint(tmp_path)
        while not handle.done():
            time.sleep(0.01)
        monkeypatch.undo()
        engine.step(*batch(1))
        with pytest.warns(RuntimeWarning, match="disk is full.*saving step 2 now"):
            second = engine.save_checkpoint(tmp_path)
        assert second.wait() == str(tmp_path / "step-00000002")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # reported once: the save after that is silent
            engine.save_checkpoint(tmp_path).wait()
            assert engine.wait_for_checkpoint() == str(tmp_path / "step-00000002")


def test_unwritable_directory_is_one_line(tmp_path) -> None:
    afile = tmp_path / "file"
    afile.write_text("keep me")
    with make_engine() as engine:
        for where in (afile, afile / "sub", "/proc/megatrain-nope"):
            with pytest.raises(MegatrainError) as err:
                engine.save_checkpoint(where)
            assert "\n" not in str(err.value) and str(where) in str(err.value)
        engine.step(*batch(0))
        engine.save_checkpoint(tmp_path / "ok").wait()  # and the writer still works
    assert afile.read_text() == "keep me"


# One warm process forks a re-saving writer per trial; each kills itself just before its k-th rename / replace.
ZYGOTE = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[1])
    from test_checkpoint_failures import make_engine
    from megatrain.runtime import Engine

    make_engine().close()  # torch's one-off set-up, before any fork
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        directory, kill_at = line.split()
        if os.fork() == 0:
            print(os.getpid(), flush=True)
            engine = Engine.load_checkpoint(directory)
            calls = [0]

            def counted(real):
                def run(*args, **kwargs):
                    calls[0] += 1
                    if calls[0] == int(kill_at):
                        os.kill(os.getpid(), signal.SIGKILL)
                    return real(*args, **kwargs)
                return run
            os.rename, os.replace = counted(os.rename), counted(os.replace)
            engine.save_checkpoint(directory, extra={"copy": "new"}, blocking=True)
            open(directory + ".finished", "w").close()
            os._exit(0)
""")


def test_kill_9_while_resaving_a_step_never_leaves_it_unloadable(tmp_path) -> None:
    with make_engine() as engine:
        engine.step(*batch(0))
        engine.step(*batch(1))
        reference = weights(engine)
        trials = [tmp_path / f"kill-at-{k}" for k in range(1, 8)]  # the protocol renames 5 times: 6 and 7 finish
        for directory in trials:
            engine.save_checkpoint(directory, extra={"copy": "old"}, blocking=True)
    zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE, os.path.dirname(__file__)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for k, directory in enumerate(trials, start=1):
            zygote.stdin.write(f"{directory} {k}\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            deadline = time.monotonic() + 120
            while _alive(pid) and time.monotonic() < deadline:  # killed, or finished
                time.sleep(0.02)
    finally:
        zygote.kill()
        zygote.wait()
    finished = [os.path.exists(f"{d}.finished") for d in trials]
    for directory in trials:
        with Engine.load_checkpoint(directory) as loaded:  # step 2 loads at every moment, old or new copy
            assert loaded.step_count == 2 and same(weights(loaded), reference), directory
            assert loaded.checkpoint_extra in ({"copy": "old"}, {"copy": "new"})
            loaded.save_checkpoint(directory, extra={"copy": "after"}, blocking=True)  # the next save cleans up
        assert sorted(os.listdir(directory)) == ["latest", "step-00000002"], sorted(os.listdir(directory))
        with Engine.load_checkpoint(directory) as loaded:
            assert loaded.checkpoint_extra == {"copy": "after"} and same(weights(loaded), reference)
    assert not any(finished[:5]) and all(finished[5:]), finished  # each of the 5 renames was a kill point


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_failed_prune_says_the_new_checkpoint_is_saved(tmp_path, monkeypatch) -> None:
    def refuse(directory, newest, keep):
        raise PermissionError(13, "Permission denied", str(tmp_path / "step-00000001"))

    with make_engine() as engine:
        engine.step(*batch(0))
        monkeypatch.setattr(checkpoint_directory, "prune", refuse)
        with pytest.raises(CheckpointError, match="step-00000001 is saved, but removing older ones") as err:
            engine.save_checkpoint(tmp_path).wait()
        assert "\n" not in str(err.value)
        with Engine.load_checkpoint(tmp_path) as loaded:
            assert loaded.step_count == 1 and same(weights(loaded), weights(engine))
