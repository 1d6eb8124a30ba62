"""The live progress display: step, loss, token accuracy, the experts' load (MoE), tokens/s (positions processed),
labelled tokens trained, MFU, ETA, GPU and host memory.

Styles: ``tqdm`` or ``rich`` when installed, else ``plain`` (a line rewritten in place with ``\\r``
on a terminal, a new line every ``log_every`` steps otherwise, e.g. in a log file), or ``none``.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, Mapping, TextIO

from . import metrics_routing


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def choose_style(requested: str, stream: TextIO) -> str:
    """auto: tqdm (or rich) on a terminal when installed, plain otherwise."""
    if requested != "auto":
        if requested in ("tqdm", "rich") and not _importable(requested):
            return "plain"
        return requested
    if stream.isatty():
        for name in ("tqdm", "rich"):
            if _importable(name):
                return name
    return "plain"


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_seconds(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def describe(m: Mapping[str, Any]) -> str:
    """The fields of one metrics record a person wants to see, in one short line."""
    parts = [f"loss {m['loss']:.4f}"]
    if m.get("token_accuracy") is not None:
        parts.append(f"acc {100 * m['token_accuracy']:.1f}%")
    if m.get("eval_loss") is not None:
        parts.append(f"eval {m['eval_loss']:.4f}")
    if (routing := metrics_routing.progress_part(m)) is not None:
        parts.append(routing)
    if m.get("epoch") is not None:
        parts.append(f"epoch {m['epoch']:.2f}")
    # tokens/s counts positions processed (padding and prompts included); the loss, labelled tokens only.
    parts.append(f"{m['tokens_per_second']:,.0f} tok/s (positions)")
    if m.get("trained_tokens") is not None:
        parts.append(f"{m['trained_tokens']:,} labelled trained")
    if m.get("mfu") is not None:
        with_attention = m.get("mfu_with_attention")
        parts.append(f"MFU {100 * m['mfu']:.1f}% (6 x N_matmul)" + (f", {100 * with_attention:.1f}% with attention"
                                                          if with_attention is not None else ""))
    elif m.get("model_tflops") is not None:
        parts.append(f"{m['model_tflops']:.3g} TFLOP/s (6 x N_matmul)" + (
            f", {m['model_tflops_with_attention']:.3g} with attention"
            if m.get("model_tflops_with_attention") is not None else ""))
    parts.append(f"lr {m['lr']:.2e}")
    if m.get("gpu_memory_bytes"):
        parts.append(f"GPU {format_bytes(m['gpu_memory_bytes'])}")
    parts.append(f"host {format_bytes(m['host_memory_bytes'])}")
    return "  ".join(parts)


class Progress:
    """One training run's display. ``update`` after each step; ``close`` at the end (idempotent)."""

    def __init__(self, style: str, total_steps: int, first_step: int = 0, log_every: int = 10,
                 stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.style = choose_style(style, self.stream)
        self.total = total_steps
        self.first = first_step
        self.log_every = log_every
        self.start = time.perf_counter()
        self._bar: Any = None
        self._task: Any = None
        if self.style == "tqdm":
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=first_step, unit="step", file=self.stream,
                             dynamic_ncols=True)
        elif self.style == "rich":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
                TimeRemainingColumn

            self._bar = RichProgress(TextColumn("step"), MofNCompleteColumn(), BarColumn(), TimeRemainingColumn(),
                                     TextColumn("{task.fields[info]}"), console=Console(file=self.stream))
            self._bar.start()
            self._task = self._bar.add_task("train", total=total_steps, completed=first_step, info="")

    def update(self, metrics: Mapping[str, Any]) -> None:
        step = metrics["step"]
        info = describe(metrics)
        if self.style == "tqdm":
            self._bar.set_postfix_str(info, refresh=False)
            self._bar.update(step - self._bar.n)
        elif self.style == "rich":
            self._bar.update(self._task, completed=step, info=info)
        elif self.style == "plain":
            done = step - self.first
            elapsed = time.perf_counter() - self.start
            eta = elapsed / done * (self.total - step) if done else 0.0
            line = f"step {step}/{self.total}  {info}  ETA {format_seconds(eta)}"
            if self.stream.isatty():
                self.stream.write("\r\033[K" + line)
                self.stream.flush()
            elif step % self.log_every == 0 or step == self.total or done == 1:
                self.stream.write(line + "\n")
                self.stream.flush()

    def message(self, text: str) -> None:
        """A line that must not be overwritten by the bar."""
        if self.style == "tqdm":
            self._bar.write(text, file=self.stream)
        elif self.style == "rich":
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            if self.style == "plain" and self.stream.isatty():
                self.stream.write("\r\033[K")
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            if self.style == "tqdm":
                self._bar.close()
            else:
                self._bar.stop()
            self._bar = None
        elif self.style == "plain" and self.stream.isatty():
            self.stream.write("\n")
            self.stream.flush()
        self.style = "none" if self.style != "plain" else "closed"


def print_summary(text: str) -> None:
    """The run's summary on stdout (what ``megatrain-train ... > log.txt`` keeps), and on stderr as well where that
    is not the same file (a terminal showing the progress shows the summary once)."""
    print(text, flush=True)
    if not _same_file(sys.stdout, sys.stderr):
        print(text, file=sys.stderr, flush=True)


def _same_file(a: Any, b: Any) -> bool:
    try:
        x, y = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (AttributeError, OSError, ValueError):  # a stream without a file descriptor (captured): not the same
        return False
    return (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)
