"""Two nodes on one machine: two torchrun launchers (--nnodes 2 --nproc-per-node 1) meet at a c10d rendezvous on
localhost, as two nodes would at rank 0's host. They train and checkpoint into one shared --out; rank 0 alone writes metrics and the export; the losses are one process's."""
from __future__ import annotations

import os
import socket
import subprocess

import pytest

from cli_ranks import ENV, TINY, TORCHRUN, TRAIN, close, losses, ok, ok_here, train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not on PATH")
def test_two_nodes_on_localhost_train_checkpoint_and_export(tmp_path, capsys):
    one, out, export = str(tmp_path / "one"), str(tmp_path / "shared-out"), str(tmp_path / "export")
    run = ["--batch", "4", "--steps", "3"]
    ok_here(capsys, "--out", one, *run)  # the one-process run in this process (cli_ranks.here)
    port = _free_port()
    nodes = []
    for node in range(2):
        cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", "test-nodes", TRAIN, *TINY, *run, "--out", out, "--export-on-finish",
               export]
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV))
    errs = [p.communicate(timeout=300)[1] for p in nodes]
    for p, err in zip(nodes, errs):
        assert p.returncode == 0, err[-3000:]
    close(losses(out), losses(one), [1, 2, 3])
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step-00000003"]
    assert os.path.isfile(os.path.join(export, "config.json"))
    assert sum("trained steps 1-3" in err for err in errs) == 1  # rank 0 reports, the other node says nothing


@pytest.mark.slow
@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not on PATH")
def test_two_nodes_with_node_local_spill_directories_train_and_checkpoint(tmp_path):
    """Each node spills its rank's state to its own --spill-dir (a node-local disk); --out is shared. Spilled state
    trains the same numbers as state in RAM."""
    one, out = str(tmp_path / "one"), str(tmp_path / "shared-out")
    run = ["--batch", "4", "--steps", "3", "--save-every", "2"]
    ok(train("--out", one, *run))
    port = _free_port()
    nodes = []
    for node in range(2):
        cmd = [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", "test-spill", TRAIN, *TINY, *run, "--out", out, "--spill", "all",
               "--spill-dir", str(tmp_path / f"node{node}-local")]
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV))
    errs = [p.communicate(timeout=300)[1] for p in nodes]
    for p, err in zip(nodes, errs):
        assert p.returncode == 0, err[-3000:]
    close(losses(out), losses(one), [1, 2, 3])
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step-00000002", "step-00000003"]
    assert sum(f"spilling master, m, v and grads to {tmp_path / 'node0-local'}" in err for err in errs) == 1, errs
