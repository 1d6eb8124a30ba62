"""How often clipping changes the update: each step's pre-clip gradient norm in megatrain-train runs, and the share
of steps whose norm exceeds max_norm (then the clip coefficient max_norm / norm < 1 scales the whole gradient).

    python benchmarks/clip_frequency.py --steps 300 --out benchmarks/results
    python benchmarks/clip_frequency.py --chat-model DIR --chat-data chat.jsonl   # a real model and chat data

Runs (two at a time, one thread each) the demo (``megatrain-train`` with no model: its 3.3M-parameter model on
pydoc text) and a chat fine-tune, both with clipping at ``--max-norm`` (1.0, the default of megatrain-train, the
Hugging Face Trainer, TRL and torchtitan), and reads ``grad_norm`` (the global norm before clipping) from each
run's metrics.jsonl. Without ``--chat-model`` the chat fine-tune is of the test suite's tiny random Llama (its
byte-level BPE tokenizer with a ChatML template, tests/chat_model.py) on its chat records: its norms describe a
model trained from scratch, not a pretrained one; pass a real model for that. Writes
``<date>_cpu_clip_frequency.json`` and ``.md`` (never overwriting an earlier run's).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

from result_files import machine, write_report

HERE = os.path.dirname(os.path.abspath(__file__))


def tiny_chat(root: str) -> tuple[str, str]:
    """The test suite's tiny chat model and its records (x 16) in ``root``: (model directory, chat.jsonl)."""
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import chat_model  # noqa: E402  (tests/chat_model.py: the tokenizer, template and model the tests train)

    model = os.path.join(root, "chat-model")
    chat_model.write_tokenizer(model)
    chat_model.write_model(model, vocab_size=300)
    data = os.path.join(root, "chat.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(r) for r in chat_model.RECORDS * 16) + "\n")
    return model, data


def start(name: str, args: list[str], steps: int, max_norm: float, root: str) -> subprocess.Popen:
    out = os.path.join(root, name)
    cmd = ["megatrain-train", *args, "--steps", str(steps), "--max-grad-norm", str(max_norm), "--out", out,
           "--progress", "none", "--no-plot", "--save-every", "0"]
    return subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def norms(root: str, name: str) -> list[float]:
    """The pre-clip gradient norm of each step of a run, from its metrics.jsonl (evaluation rows skipped)."""
    with open(os.path.join(root, name, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [float(r["grad_norm"]) for r in rows if "step" in r and r.get("grad_norm") is not None]


def stats(xs: list[float], max_norm: float) -> dict[str, float]:
    """The share of steps over max_norm (overall, in the first and last tenth) and the norms' quantiles."""
    tenth = max(1, len(xs) // 10)
    share = lambda ys: sum(y > max_norm for y in ys) / len(ys)  # noqa: E731
    q = statistics.quantiles(xs, n=20)
    return {"steps": len(xs), "clipped_share": share(xs), "clipped_share_first_tenth": share(xs[:tenth]),
            "clipped_share_last_tenth": share(xs[-tenth:]), "median": statistics.median(xs), "p5": q[0],
            "p95": q[-1], "max": max(xs), "min": min(xs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--chat-model", help="a Hugging Face model directory with tokenizer.json and a chat template")
    p.add_argument("--chat-data", help="the chat JSONL to fine-tune on (with --chat-model)")
    p.add_argument("--chat-args", default="--seq-len 64 --batch 4 --lr 1e-4 --warmup-steps 10",
                   help="more megatrain-train options for the chat run")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    if bool(args.chat_model) != bool(args.chat_data):
        p.error("--chat-model and --chat-data go together")
    with tempfile.TemporaryDirectory(prefix="clip-frequency-") as root:
        model, data = (args.chat_model, args.chat_data) if args.chat_model else tiny_chat(root)
        chat = ["--model", model, "--tokenizer", os.path.join(model, "tokenizer.json"), "--data", data,
                "--compute-dtype", "fp32", *args.chat_args.split()]
        runs = {"demo": [], "chat": chat}
        procs = {name: start(name, a, args.steps, args.max_norm, root) for name, a in runs.items()}
        for name, proc in procs.items():
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise SystemExit(f"{name} run failed: {err.decode()[-2000:]}")
        series = {name: norms(root, name) for name in runs}
    result = {
        "date": datetime.date.today().isoformat(), "machine": machine(),
        "command": " ".join(["python benchmarks/clip_frequency.py", *sys.argv[1:]]),
        "max_norm": args.max_norm,
        "runs": {"demo": "megatrain-train (the demo: 3.3M parameters, pydoc text, 8 x 256 tokens, fp32 on a CPU)",
                 "chat": (f"megatrain-train --model {args.chat_model} --data {args.chat_data}" if args.chat_model
                          else "the tiny random Llama of tests/chat_model.py (2 layers, hidden 64) on its chat "
                               "records x 16") + f" {args.chat_args}"},
        "stats": {name: stats(xs, args.max_norm) for name, xs in series.items()},
        "grad_norms": series,
    }
    lines = [f"# How often clipping at max_norm {args.max_norm} changes the update ({result['date']}, "
             f"{result['machine']['cpu']}, {result['machine']['cores']} shared cores)", "",
             f"`{result['command']}`", "",
             "| run | steps | steps clipped | first tenth | last tenth | median norm | p5 | p95 | max |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in result["stats"].items():
        lines.append(f"| {name} | {s['steps']} | {s['clipped_share']:.1%} | {s['clipped_share_first_tenth']:.1%} | "
                     f"{s['clipped_share_last_tenth']:.1%} | {s['median']:.3f} | {s['p5']:.3f} | {s['p95']:.3f} | "
                     f"{s['max']:.3f} |")
    lines += ["", *(f"- {name}: {what}" for name, what in result["runs"].items())]
    write_report(os.path.join(args.out, f"{result['date']}_cpu_clip_frequency"), result, lines, indent=1)


if __name__ == "__main__":
    main()
