"""A log of the step's operations, in the order the host issued them.

Tests read it to check the schedule's invariants (no compute before its load,
no load into a slot still in use, the next step's load of a block after its
AdamW update, never more than K blocks resident). Off by default; when off,
``record`` costs one attribute check.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class LogEntry:
    # "h2d", "compute", "release", "d2h", "adam_submit", "adam_begin", "adam_end"; with spill files, the AdamW
    # worker's I/O: "spill_read" (a piece's staged reads issued; phase "ahead": before its job arrived),
    # "spill_write" (its writes behind issued), "spill_discard" (read ahead, then dropped unused); host
    # checkpoints: "ckpt_drain", "ckpt_reload" (one per piece), "ckpt_use" (the recompute takes the micro-batch's
    # input)
    op: str
    step: int
    block: int
    slot: int = -1  # device slot, for h2d / compute / release; reload buffer, for ckpt_reload / ckpt_use
    load: int = -1  # position in the step's load sequence, for h2d / compute / release
    phase: str = ""  # "fwd" or "bwd"; "ahead" for a spill read issued before its job
    lo: int = -1  # the piece's first element in its block, for spill_read / spill_write / spill_discard
    micro: int = -1  # micro-batch, for the ckpt_ ops
    piece: int = -1  # piece of the micro-batch's checkpoint, for ckpt_drain / ckpt_reload
    part: int = -1  # h2d / compute / release of a layer in parts: 0 its dense part, 1 + j expert group j


class EventLog:
    def __init__(self) -> None:
        self.enabled = False
        self.entries: list[LogEntry] = []
        self._lock = threading.Lock()  # the AdamW worker appends from its own thread

    def record(self, op: str, step: int, block: int, **fields: object) -> None:
        if self.enabled:
            entry = LogEntry(op, step, block, **fields)  # type: ignore[arg-type]
            with self._lock:
                self.entries.append(entry)

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
