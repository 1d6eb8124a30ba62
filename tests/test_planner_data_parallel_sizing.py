"""``megatrain-plan size`` and ``ram`` with --gpus-per-node / --nodes: per GPU, per node and the collectives,
checked against the planner's formulas by hand; bad values are one line and exit 2."""
from __future__ import annotations

import json

import pytest

from megatrain.planner.commands import cli
from megatrain.planner.costs import data_parallel
from megatrain.planner.profiling.hardware import GiB
from megatrain.planner.shapes.model_shapes import PRESETS


def _json(argv: list[str], capsys) -> dict:
    assert cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_size_per_gpu_per_node_and_the_collectives_by_hand(capsys) -> None:
    """4 ranks at 0.1 GB/s: the step is the collectives, (L + 2) latencies plus r x bytes / bw per phase."""
    m = PRESETS["shape:Llama-3.2-1B"]
    data = _json(["size", "--model", "shape:Llama-3.2-1B", "--seq-len", "1024", "--batch", "8", "--gpus-per-node", "4",
                  "--intra-gbps", "0.1"], capsys)
    assert (data["world"], data["gpus_per_node"], data["nodes"]) == (4, 4, 1)
    N, L, layer, E = m.numel_total, m.num_layers, m.numel_layer, m.numel_embedding
    tied = E if m.tie_word_embeddings else 0
    lat = (L + 2) * data_parallel.COLLECTIVE_LATENCY_S["gpu"]
    fwd = lat + 3 / 4 * 2 * (N + tied) / 0.1e9
    bwd = lat + 3 / 4 * (2 * L * layer + 4 * N) / 0.1e9
    shard = lambda n: -(-(-(-n // 4)) // 64) * 64  # noqa: E731  align64(ceil(n / 4))
    NW = shard(E) + L * shard(layer) + shard(m.numel_head)
    for e in data["hardware"]:
        dp = e["data_parallel"]
        assert dp["comm_seconds"] == pytest.approx(fwd + bwd)
        assert dp["step_seconds"] == pytest.approx(fwd + bwd, rel=0.02)
        assert dp["efficiency"] == pytest.approx(dp["single_step_seconds"] / (4 * dp["step_seconds"]))
        assert dp["tokens_per_second"] == pytest.approx(8 * 1024 / dp["step_seconds"])
        assert dp["per_node_host_bytes"] == 4 * e["host_ram_bytes"]       # 4 ranks share the node
        assert dp["per_gpu_bytes"] == e["gpu_bytes"]
        assert e["host_ram_bytes"] > 18 * NW                               # master, m, v, grads 4 B + shadow 2 B
        assert e["host_ram_bytes"] < 18 * N                                # not the whole model's state
    assert data["node_host_ram_bytes"] == 4 * data["host_ram_bytes"]
    fastest = min(data["hardware"], key=lambda e: e["data_parallel"]["step_seconds"])
    assert data["fastest_hardware"] == fastest["hardware"]
    assert data["efficiency"] == fastest["data_parallel"]["efficiency"]
    assert cli.main(["size", "--model", "shape:Llama-3.2-1B", "--seq-len", "1024", "--batch", "8", "--gpus-per-node",
                    "4",
                     "--intra-gbps", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "data parallel: 4 ranks (4 per node x 1 node), 2 sequences per rank" in out
    assert "efficiency" in out and "collectives" in out and "per GPU" in out


def test_ram_per_node_ladder_with_ranks(capsys) -> None:
    """The ladder's RAM is a node's: batches are multiples of the 6 ranks, each row's plan fits the node's
    usable RAM with its 3 ranks together, and the throughput is all ranks' (global tokens / their step)."""
    data = _json(["ram", "--model", "shape:Llama-3.2-1B", "--seq-len", "1024", "--hardware", "H100-SXM",
                  "--gpus-per-node", "3", "--nodes", "2", "--max-batch", "96"], capsys)
    assert (data["world"], data["ram_per"]) == (6, "node")
    fitted = [r for r in data["ladder"] if r["batch"]]
    assert fitted
    for r in fitted:
        dp = r["data_parallel"]
        assert r["batch"] % 6 == 0 and r["batch"] <= 96
        assert r["host_ram_bytes"] == dp["per_node_host_bytes"] <= int(r["ram_bytes"] * 0.94)
        assert r["tokens_per_second"] == pytest.approx(r["batch"] * 1024 / dp["step_seconds"])
        assert 0 < dp["efficiency"] <= 1.0
    assert not any(r["batch"] for r in data["ladder"] if r["ram_bytes"] < 8 * GiB)


@pytest.mark.parametrize("argv, says", [
    (["size", "--batch", "12", "--gpus-per-node", "8"], "does not divide among 8 ranks"),
    (["size", "--batch", "8", "--gpus-per-node", "0"], "must be >= 1"),
    (["size", "--batch", "8", "--nodes", "-2"], "must be >= 1"),
    (["ram", "--gpus-per-node", "0"], "must be >= 1"),
    (["ram", "--nodes", "x"], "is not an integer"),
])
def test_bad_rank_values_are_one_line_and_exit_2(argv, says, capsys) -> None:
    try:
        rc = cli.main([argv[0], "--model", "shape:Llama-3.2-1B", "--seq-len", "1024", *argv[1:]])
    except SystemExit as e:  # argparse's refusals
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
