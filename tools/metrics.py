"""What a run measured: one JSON line per step in ``metrics.jsonl``, and the end-of-run summary.

Model FLOPs follow the benchmark protocol (benchmarks/README.md; ``planner/shapes/model_flops.py``): 6 x N_matmul x
(positions processed) per step, N_matmul the parameters of the matrix multiplies a token runs through (lm_head
included, the input embedding a lookup, a mixture of experts' routed experts only), recompute not counted, attention
FLOPs not included (``model_tflops``, ``mfu``); the same with causal attention's forward and backward FLOPs by the
model convention at the run's sequence length added (``model_tflops_with_attention``, ``mfu_with_attention``); and
beside them the every-parameter figure, 6 x every active parameter (``all_params_tflops``; ``TokenFlops``). MFU
divides by the matmul peak of the compute dtype when one is known (a GPU preset, or a profile measured by
``megatrain-plan profile``).
"""
from __future__ import annotations

import json
import os
import resource
import sys
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from megatrain.planner.shapes import model_shapes

from . import metrics_routing
from .progress import format_bytes


@dataclass(frozen=True)
class TokenFlops:
    """The FLOPs per position processed a run's TFLOP/s figures count.

    ``model``: 6 x N_matmul (``ModelShape.model_flops_per_token``: the matmul parameters a token runs through,
    lm_head included, the input embedding not; attention and recompute not counted). ``attention``: causal attention
    forward + backward at ``seq`` tokens per row by the model convention, backward 2x forward
    (``ModelShape.attention_model_flops_per_token``: L x 3 x 2 x heads x head_dim x (seq + 1)); packed documents are
    counted as whole rows, an upper bound on what document attention computes. ``all_params``: 6 x every parameter
    a token uses (``ModelShape.all_params_flops_per_token``, the embedding included), reported beside; 0: not given.
    """

    model: float
    attention: float
    seq: int
    all_params: float = 0.0

    @classmethod
    def of(cls, config: Mapping[str, Any], seq: int) -> "TokenFlops":
        """For a model given by its config.json fields (``ModelConfig.to_dict()``) trained on rows of ``seq``."""
        shape = model_shapes.from_config(config)
        return cls(shape.model_flops_per_token(), shape.attention_model_flops_per_token(seq), seq,
                   shape.all_params_flops_per_token())

    def figures(self, tokens_per_second: float, peak_tflops: float | None) -> dict[str, float | None]:
        """model TFLOP/s and MFU without attention and with it, and the every-parameter TFLOP/s, at
        ``tokens_per_second``."""
        tflops = self.model * tokens_per_second / 1e12
        with_attention = (self.model + self.attention) * tokens_per_second / 1e12
        return {"model_tflops": tflops, "model_tflops_with_attention": with_attention,
                "mfu": tflops / peak_tflops if peak_tflops else None,
                "mfu_with_attention": with_attention / peak_tflops if peak_tflops else None,
                "all_params_tflops": self.all_params * tokens_per_second / 1e12 if self.all_params else None}


def host_peak_bytes() -> int:
    """Peak resident memory of this process (ru_maxrss: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def gpu_peak_bytes(device: torch.device) -> int:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


def matmul_peak_tflops(device: torch.device, compute_dtype: str) -> tuple[float | None, str]:
    """The matmul peak MFU is measured against, and where it comes from; (None, why) when unknown.

    On a CPU the planner only guesses the peak, so MFU is reported only from a measured profile.
    """
    try:
        from megatrain.planner.profiling.profiler import this_machine

        hw = this_machine()
        measured = hw.source.startswith("measured")
        if (device.type == "cuda" and not hw.device_is_host) or (device.type == "cpu" and hw.device_is_host
                                                                 and measured):
            return hw.tflops(compute_dtype), hw.source
    except Exception as e:  # a broken saved profile must not stop training; say why MFU is missing
        return None, f"no peak: {e}"
    return None, "no measured peak for this CPU (run megatrain-plan profile)"


class MetricsLog:
    """Appends one JSON object per step to ``path``, each row one whole ``write`` (a killed run keeps its rows).

    A row the disk cannot take (full, over quota) is cut off again, so the file always ends with a whole row, and
    the ``OSError`` names the file. ``sync`` (at each checkpoint) puts the rows on the disk with the checkpoint.
    """

    def __init__(self, path: str, append: bool) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o666)
        self._end = os.lseek(self._fd, 0, os.SEEK_END)  # where the last whole row ends

    def write(self, record: Mapping[str, Any]) -> None:
        row = (json.dumps(record) + "\n").encode("utf-8")
        try:
            written = 0
            while written < len(row):
                written += os.write(self._fd, row[written:])
        except OSError as e:
            try:
                os.ftruncate(self._fd, self._end)  # no torn row: the file ends with the last whole one
            except OSError:
                pass
            raise OSError(e.errno, e.strerror, self.path) from None
        self._end += len(row)

    def sync(self) -> None:
        try:
            os.fsync(self._fd)
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.path) from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def remove_if_empty(path: str) -> None:
    """Remove a metrics file no step was written to (a run that stopped before its first step)."""
    if os.path.isfile(path) and os.path.getsize(path) == 0:
        os.remove(path)


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl; a line that is not one (a torn last line of a killed run) is skipped."""
    records = []
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:  # JSON or UTF-8 error: a line cut short by a kill, or not ours
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    return records


def truncate_after(path: str, step: int) -> int:
    """Keep the records up to ``step`` (a resumed run continues from there): one history. Atomic; rows dropped."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        total = sum(1 for line in f if line.strip())
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    if len(kept) == total:
        return 0
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in kept:
            f.write(json.dumps(r) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return total - len(kept)


def summarize(records: list[dict[str, Any]], num_parameters: int, flops: TokenFlops, peak_tflops: float | None,
              device: torch.device, extra: Mapping[str, Any],
              history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Whole-run figures. ``records``: this invocation's steps (the segment a resume trained); ``history``: the
    run's steps from its first (metrics.jsonl; default ``records``). Losses and token counts describe the whole
    run, ``segment`` this invocation alone; throughput is this invocation's, without its first step (start-up,
    first loads). ``tokens`` are positions processed (what tokens/s and TFLOP/s count), ``trained_tokens`` the
    labelled tokens the loss averages over."""
    history = history or records
    steady = records[1:] if len(records) > 1 else records
    seconds = sum(r["step_time_s"] for r in steady)
    tokens = sum(r["step_tokens"] for r in steady)
    tps = tokens / seconds if seconds > 0 else 0.0
    out: dict[str, Any] = {
        "steps": records[-1]["step"] if records else 0,
        "first_step": history[0]["step"] if history else 0,
        "first_loss": history[0]["loss"] if history else None,
        "last_loss": records[-1]["loss"] if records else None,
        "tokens": records[-1]["tokens"] if records else 0,
        "trained_tokens": records[-1].get("trained_tokens", 0) if records else 0,
        "segment": _segment(records, history),
        "tokens_per_second": tps,
        **flops.figures(tps, peak_tflops),
        "model_flops_per_token": flops.model,
        "attention_flops_per_token": flops.attention,
        "attention_seq_len": flops.seq,
        "peak_tflops": peak_tflops,
        "num_parameters": num_parameters,
        "device": str(device),
        "gpu_peak_bytes": gpu_peak_bytes(device),
        "host_peak_bytes": host_peak_bytes(),
        "epoch": records[-1].get("epoch") if records else None,
        **metrics_routing.summary(records),
    }
    evaluated = [r for r in records if "eval_loss" in r]
    if evaluated:  # the last evaluation of this invocation
        out.update({k: evaluated[-1][k] for k in ("eval_loss", "eval_perplexity", "eval_tokens")},
                   eval_step=evaluated[-1]["step"])
        if "eval_token_accuracy" in evaluated[-1]:
            out["eval_token_accuracy"] = evaluated[-1]["eval_token_accuracy"]
    out.update(extra)
    return out


def _segment(records: list[dict[str, Any]], history: list[dict[str, Any]]) -> dict[str, Any] | None:
    """This invocation's part of a resumed run (None when it trained the run from its first step)."""
    if not records or not history or history[0]["step"] == records[0]["step"]:
        return None
    before = [r for r in history if r["step"] < records[0]["step"]]
    return {"first_step": records[0]["step"], "steps": records[-1]["step"], "first_loss": records[0]["loss"],
            "last_loss": records[-1]["loss"],
            "tokens": records[-1]["tokens"] - (before[-1]["tokens"] if before else 0),
            "trained_tokens": records[-1].get("trained_tokens", 0) - (before[-1].get("trained_tokens", 0)
                                                                      if before else 0)}


def format_summary(s: Mapping[str, Any]) -> str:
    segment = s.get("segment")
    lines = [
        f"trained steps {s['first_step']}-{s['steps']}: loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}; "
        f"{s['tokens']:,} positions processed, {s['trained_tokens']:,} labelled tokens trained"
        if s["first_loss"] is not None else "trained no steps",
        *([f"  this run   steps {segment['first_step']}-{segment['steps']} (resumed): loss "
           f"{segment['first_loss']:.4f} -> {segment['last_loss']:.4f}; {segment['tokens']:,} positions, "
           f"{segment['trained_tokens']:,} labelled tokens"] if segment else []),
        *([packing_line(s["packing"])] if s.get("packing") else []),
        *([f"skipped      {s['skipped_steps']:,} update(s) for a non-finite gradient (NaN or inf)"
           + (": the run diverged" if s.get("diverged") else "")] if s.get("skipped_steps") else []),
        *metrics_routing.summary_line(s),
        *([f"eval         loss {s['eval_loss']:.4f}, perplexity {s['eval_perplexity']:.4g}"
           + (f", token accuracy {100 * s['eval_token_accuracy']:.2f}%" if s.get("eval_token_accuracy") is not None
              else "") + f" at step {s['eval_step']} ({s['eval_tokens']:,} labelled tokens held out)"]
          if s.get("eval_loss") is not None else []),
        f"throughput   {s['tokens_per_second']:,.0f} tokens/s (positions processed, padding included"
        + (", this invocation)" if segment else ")"),
        f"             {s['model_tflops']:.4g} model TFLOP/s (6 x N_matmul, attention not counted: 6 x "
        f"{s['model_flops_per_token'] / 6:,.0f} matmul params x tokens/s)",
        f"             {s['model_tflops_with_attention']:.4g} model TFLOP/s with attention (6 x N_matmul + causal attention "
        f"forward and backward at {s['attention_seq_len']:,} tokens per row)",
        f"MFU          " + (f"{100 * s['mfu']:.1f}% (6 x N_matmul, attention not counted), {100 * s['mfu_with_attention']:.1f}% "
                            f"with attention, of {s['peak_tflops']:g} TFLOP/s" if s["mfu"] is not None
                            else f"n/a ({s['peak_source']})"),
        f"memory       peak GPU {format_bytes(s['gpu_peak_bytes'])}" if s["gpu_peak_bytes"] else
        f"memory       no GPU ({s['device']})",
        f"             peak host RSS {format_bytes(s['host_peak_bytes'])}",
        f"outputs      {s['out']}",
        f"  metrics     {s['metrics']}",
        *([f"  summary     {s['summary']}"] if s.get("summary") else []),
        *([f"  options     {s['run_record']}"] if s.get("run_record") else []),
        f"  checkpoint  {s['checkpoint']}",
        f"  plot        {s['plot']}",
    ]
    for key in ("trace", "tensorboard", "wandb", "export"):  # each written only when asked for
        if s.get(key):
            lines.append(f"  {key:<11} {s[key]}")
    return "\n".join(lines)


def packing_line(p: Mapping[str, Any]) -> str:
    """The summary's packing line: the mode, the padding fraction and the documents cut, over the run's rows."""
    cut = {"whole": "split, longer than a row", "none": "truncated to a row"}.get(p["mode"], "continued in the "
                                                                                     "next row")
    return (f"packing      {p['mode']}: {100 * p['padding_fraction']:.1f}% of {p['positions']:,} positions padding; "
            f"{p['cut']:,} of {p['documents']:,} documents cut ({cut})"
            + (f"; {p['dropped']:,} dropped (nothing to learn: no assistant turn, or a prompt filling the row)"
               if p.get("dropped") else ""))


def write_summary(path: str, summary: Mapping[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
