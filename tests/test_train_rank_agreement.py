"""Ranks that would diverge stop before training: a rank with another data order (or plan, or options) ends every
rank with one line naming what differs; --collective-timeout bounds every collective's wait."""
from __future__ import annotations

import contextlib
import io
import os

from megatrain.runtime.distributed.process_group import DEFAULT_TIMEOUT_S
from megatrain.tools import ranks, train
from rank_processes import run_ranks

FAST = ["--seq-len", "32", "--batch", "4", "--progress", "none", "--no-plot", "--warmup-steps", "1", "--steps", "2"]


def _main(rank: int, world: int, argv: list[str]) -> tuple[int, str]:
    if rank == 1:
        argv = argv + ["--no-shuffle"]  # rank 1 alone reads the documents in corpus order
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = train.main(argv)
    return status, err.getvalue()


def test_a_rank_with_another_data_order_stops_every_rank(tmp_path):
    out = str(tmp_path / "run")
    for status, err in run_ranks(_main, 2, tmp_path, ["--out", out, *FAST]):
        assert status == 2, err
        assert err.count("\n") == 1 and "rank 1's data order differs from rank 0's" in err, err
    assert not os.path.exists(out)  # nothing written


def test_the_collective_timeout_is_read_before_the_ranks_join(tmp_path):
    assert ranks.collective_timeout(["--collective-timeout", "7.5"]) == 7.5
    assert ranks.collective_timeout([]) == DEFAULT_TIMEOUT_S
    assert ranks.collective_timeout(["--collective-timeout", "oops"]) == DEFAULT_TIMEOUT_S  # reported later
    toml = tmp_path / "run.toml"
    toml.write_text("collective_timeout = 30\n")
    assert ranks.collective_timeout(["--config", str(toml)]) == 30.0
