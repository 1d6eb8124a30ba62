"""A disk that fills up while megatrain-train writes its metrics: the file named in one line, its own exit status
(``io_failure.EXIT_IO``, not the bad-input 2), and metrics.jsonl ending with its last whole row, never a torn one."""
from __future__ import annotations

import errno
import json
import os

from megatrain.tools import io_failure, train

from test_train_runs import FAST


def test_a_full_disk_while_writing_metrics_names_the_file_and_tears_no_row(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    metrics_file = str(out / "metrics.jsonl")
    real_write, rows = os.write, []

    def disk_fills(fd: int, data) -> int:  # the third row: half of it fits, then the disk is full
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target != os.path.realpath(metrics_file):
            return real_write(fd, data)
        rows.append(bytes(data))
        if len(rows) == 3:
            return real_write(fd, bytes(data)[:len(data) // 2])
        if len(rows) > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", disk_fills)
    assert train.main(["--out", str(out), "--steps", "6"] + FAST) == io_failure.EXIT_IO
    err = capsys.readouterr().err
    assert err.endswith(f"megatrain-train: error: {metrics_file}: No space left on device; free space (or fix the "
                        f"disk) and run again\n"), err
    assert "Traceback" not in err
    with open(metrics_file, "rb") as f:
        text = f.read().decode()
    assert text.endswith("\n") and [json.loads(line)["step"] for line in text.splitlines()] == [1, 2]


def test_a_path_error_keeps_the_bad_input_status():
    assert io_failure.exit_status(OSError(errno.EACCES, "Permission denied", "x")) == 2
    assert io_failure.exit_status(OSError(errno.EDQUOT, "Disk quota exceeded", "x")) == io_failure.EXIT_IO
