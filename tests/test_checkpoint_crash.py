"""Crash safety: kill -9 a training process at random moments while it writes checkpoints.

Each trial trains a small model in a subprocess and saves an asynchronous
checkpoint after every step (keep=2), so a kill lands in a step, a snapshot,
a tensorstore write, an fsync, the manifest, a rename, the ``latest`` update or
a prune. Afterwards: ``latest`` loads, every complete step directory loads and
verifies, and each holds exactly the state training had at its step (compared
with a reference run in this process): the previous checkpoint always loads and
the new one is complete or ignored, never half. Writers are forked from one warm
process to keep the test fast; ``MEGATRAIN_CRASH_TRIALS`` raises their number.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import zlib

import torch

from megatrain.runtime import Engine, ModelConfig, OptimizerConfig

CONFIG = ModelConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4)
TRIALS = int(os.environ.get("MEGATRAIN_CRASH_TRIALS", "6"))

# A zygote pays torch's start-up once, then forks one writer per trial (single-threaded, so fork is safe).
ZYGOTE = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, sys.argv[1])
    from test_checkpoint_crash import make_engine, batch

    make_engine().close()  # torch's one-off set-up, before any fork
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # killed writers are reaped at once
    for line in sys.stdin:
        if os.fork() == 0:
            engine = make_engine()
            step = 0
            while True:
                engine.step(*batch(step))
                step += 1
                handle = engine.save_checkpoint(line.strip(), extra={"step": step}, keep=2)
                if step == 1:
                    handle.wait()
                    print("ready", os.getpid(), flush=True)
""")


def make_engine() -> Engine:
    return Engine(CONFIG, OptimizerConfig(lr=1e-3), compute_dtype=torch.float32, device="cpu", seed=1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, CONFIG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(step))
    return ids, ids


def master_crc(engine: Engine) -> int:
    engine.synchronize()
    return zlib.crc32(engine.store.master.tensor.numpy())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_kill_9_during_checkpoints_never_leaves_a_half_checkpoint(tmp_path) -> None:
    rng = random.Random()
    zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE, os.path.dirname(__file__)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    directories = [tmp_path / f"trial{trial}" for trial in range(TRIALS)]
    try:
        for directory in directories:
            zygote.stdin.write(f"{directory}\n")
            zygote.stdin.flush()
            word, pid = zygote.stdout.readline().split()
            assert word == "ready"
            time.sleep(rng.uniform(0.0, 0.5))  # a random moment of the step / save loop
            os.kill(int(pid), signal.SIGKILL)
            while _alive(int(pid)):
                time.sleep(0.01)
    finally:
        zygote.kill()
        zygote.wait()

    loaded: dict[int, list[int]] = {}  # step -> master CRCs seen in checkpoints
    for directory in directories:
        complete = sorted(p.name for p in directory.iterdir()
                          if p.name.startswith("step-") and not p.name.endswith(".tmp"))
        with Engine.load_checkpoint(directory) as latest:
            assert latest.checkpoint_extra == {"step": latest.step_count}
            newest = latest.step_count
        for name in complete:  # every step directory a reader can see is whole
            with Engine.load_checkpoint(directory / name) as e:
                assert e.checkpoint_extra == {"step": e.step_count} and e.step_count <= newest
                loaded.setdefault(e.step_count, []).append(master_crc(e))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the writers ran (OMP_NUM_THREADS=1): fp32 sums split over threads differ in order
    try:
        with make_engine() as reference:
            for step in range(max(loaded)):
                reference.step(*batch(step))
                for crc in loaded.get(step + 1, []):
                    assert crc == master_crc(reference), step + 1
    finally:
        torch.set_num_threads(threads)
