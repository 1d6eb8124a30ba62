"""``keep_freed_heap``: memory a step frees is used again without page faults ([Note: freed heap]).

Each case runs in a child process, since the setting holds for the whole process."""
from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from megatrain.tools import train

# A "step": take a 24 MiB tensor and a burst of 1 MiB ones (104 MiB in all, past glibc's largest adaptive trim
# threshold, 64 MiB; each below its largest adaptive mmap threshold, 32 MiB), write every page and free them all;
# the page faults of the steps after the first are counted.
STEPS = """
import json, resource, sys, torch
from megatrain.runtime import keep_freed_heap
kept = keep_freed_heap() if sys.argv[1] == "keep" else None
def step():
    big = torch.empty(6 << 20).fill_(1.0)
    burst = [torch.empty(256 << 10).fill_(1.0) for _ in range(80)]
    del big, burst
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(json.dumps({"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _faults(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's thresholds are glibc's")
def test_freed_heap_is_used_again_without_page_faults():
    returned, kept = _faults("return"), _faults("keep")
    assert kept["kept"] is True
    # glibc's own thresholds hand the memory back every step: each step faults its pages in again (at least one
    # fault per 2 MiB, even with transparent huge pages)
    assert returned["faults"] >= 5 * 64 // 2, returned
    assert kept["faults"] * 10 < returned["faults"], (kept, returned)


def test_the_program_keeps_its_freed_heap_before_it_runs(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(train, "keep_freed_heap", lambda: calls.append("heap") or True)
    monkeypatch.setattr(train, "main", lambda: calls.append("main") or 0)
    monkeypatch.setattr(train, "exit_process", lambda code: calls.append(f"exit {code}"))
    train.command()
    assert calls == ["heap", "main", "exit 0"]
