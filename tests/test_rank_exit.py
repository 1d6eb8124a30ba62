"""A rank's exit ([Note: a rank's exit] in runtime/distributed/process_group.py): a process whose group ``join``
made ends with ``os._exit``, after doing what the interpreter's finalization would have done that matters: a
checkpoint still being written by a non-daemon thread is finished, exit handlers run, buffered output is flushed.
Without a group of its own, ``exit_process`` is ``sys.exit``."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import atexit, os, sys, threading, time
    from megatrain.runtime.distributed import process_group
    if sys.argv[2] == "made":
        process_group._made.append(True)  # as join() records a group it initialised
    out = sys.argv[1]
    def late_write():  # a checkpoint writer still at work when the program returns
        time.sleep(0.5)
        with open(os.path.join(out, "thread"), "w") as f:
            f.write("written")
    threading.Thread(target=late_write, daemon=False).start()
    atexit.register(lambda: open(os.path.join(out, "atexit"), "w").close())
    print("summary line", end="")  # no newline: still in the buffer of a pipe at exit
    process_group.exit_process(3)
""")


def _run(tmp_path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), mode], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("mode", ["made", "one"])
def test_the_exit_finishes_writers_runs_handlers_and_flushes_output(tmp_path, mode):
    """``made``: a rank whose group ``join`` made (``os._exit``); ``one``: one process (``sys.exit``)."""
    done = _run(tmp_path, mode)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "summary line"
    assert (tmp_path / "thread").read_text() == "written"
    assert (tmp_path / "atexit").exists()
