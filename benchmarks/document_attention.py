"""What keeping packed documents apart costs: document attention against attention over the whole row.

    python benchmarks/document_attention.py                      # CPU: tiny model, rows of 2048 tokens
    python benchmarks/document_attention.py --seq 8192 --batch 4 # on a GPU (bf16)

Two measurements, each a ratio against its baseline in the same process, the two alternating
call by call (so machine noise hits both alike):

1. attention alone (forward + backward of ``runtime.attention.causal_attention``, the tiny model's
   heads) for several document-length mixes, against one causal SDPA over the whole row;
2. a whole training step of the tiny model (``Engine.step`` with ``position_ids``) on rows packed
   with those mixes, against the same rows without position ids (``--packing concat``).

Writes ``benchmarks/results/<date>_<device>_document_attention.{json,md,png}``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from throughput import MODELS  # noqa: E402
from result_files import figure, machine, write_report  # noqa: E402


def mixes(seq: int) -> dict[str, callable]:
    """Name -> a function of a generator giving one row's document lengths (summing to seq)."""
    def cut(lengths: list[int]) -> list[int]:
        out, total = [], 0
        for n in lengths:
            n = min(n, seq - total)
            if n <= 0:
                break
            out.append(n)
            total += n
        if total < seq:
            out.append(seq - total)
        return out

    return {
        "1 document (baseline shape)": lambda g: [seq],
        "8 equal documents": lambda g: [seq // 8] * 8,
        "mean 512 (exponential)": lambda g: cut([1 + int(x) for x in torch.empty(4 * seq // 512 + 8).exponential_(
            1 / 512, generator=g).tolist()]),
        "mean 128 (exponential)": lambda g: cut([1 + int(x) for x in torch.empty(4 * seq // 128 + 8).exponential_(
            1 / 128, generator=g).tolist()]),
        "mean 32 (exponential)": lambda g: cut([1 + int(x) for x in torch.empty(4 * seq // 32 + 8).exponential_(
            1 / 32, generator=g).tolist()]),
    }


def positions_for(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def attention_case(args, cfg, rows, device, dtype) -> dict:
    from megatrain.models.layers.attention import Documents, causal_attention

    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg["hidden_size"] // heads
    b, s = len(rows), args.seq
    documents = Documents.from_position_ids(positions_for(rows))
    q = torch.randn(b, heads, s, dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(b, kv, s, dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(b, kv, s, dim, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(b, heads, s, dim, device=device, dtype=dtype)

    def run(docs):
        out = causal_attention(q, k, v, scale=dim ** -0.5, documents=docs)
        torch.autograd.grad(out, (q, k, v), dy)

    base, ours = [], []
    for i in range(args.warmup + args.repeats):
        t_base, t_ours = timed(lambda: run(None), device), timed(lambda: run(documents), device)
        if i >= args.warmup:
            base.append(t_base)
            ours.append(t_ours)
    return {"sdpa_calls": 1 if documents is None else len(documents.groups),
            "baseline_s": statistics.median(base), "documents_s": statistics.median(ours)}


def step_case(args, cfg, rows, device, dtype) -> dict:
    from megatrain.runtime import Engine, ModelConfig, OptimizerConfig, Plan

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab_size"], (len(rows), args.seq), generator=gen)
    positions = positions_for(rows)
    labels = ids.masked_fill(positions == 0, -100)
    times: dict[str, list[float]] = {"baseline": [], "documents": []}
    engines = {name: Engine(ModelConfig(**cfg), OptimizerConfig(lr=1e-4), plan=Plan(micro_batch_size=args.batch),
                            compute_dtype=dtype, device=device, seed=0) for name in times}
    try:
        for i in range(args.warmup + args.repeats):
            for name, engine in engines.items():
                pos = positions if name == "documents" else None
                t = timed(lambda: engine.step(ids, labels, position_ids=pos).item(), device)
                if i >= args.warmup:
                    times[name].append(t)
    finally:
        for engine in engines.values():
            engine.close()
    return {"baseline_s": statistics.median(times["baseline"]), "documents_s": statistics.median(times["documents"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=sorted(MODELS))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (1: on a shared machine OpenMP's barrier waits, not the work, dominate small calls)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = MODELS[args.model]
    results = []
    for name, lengths in mixes(args.seq).items():
        g = torch.Generator().manual_seed(0)
        rows = [lengths(g) for _ in range(args.batch)]
        print(f"{name}: {sum(map(len, rows))} documents in {args.batch} rows", file=sys.stderr, flush=True)
        row = {"mix": name, "documents": sum(map(len, rows)),
               "attention": attention_case(args, cfg, rows, device, dtype),
               "step": step_case(args, cfg, rows, device, dtype)}
        for part in ("attention", "step"):
            row[part]["ratio"] = row[part]["documents_s"] / row[part]["baseline_s"]
        print(f"  attention x{row['attention']['ratio']:.2f} ({row['attention']['sdpa_calls']} SDPA calls), "
              f"step x{row['step']['ratio']:.3f}", file=sys.stderr, flush=True)
        results.append(row)
    date = datetime.date.today().isoformat()
    meta = {"date": date, "device": device.type, "dtype": str(dtype).removeprefix("torch."), "model": args.model,
            "seq": args.seq, "batch": args.batch, "repeats": args.repeats, "threads": torch.get_num_threads(),
            "machine": machine(), "results": results}
    lines = [f"# Document attention cost, {args.model}, {args.batch} x {args.seq} tokens, {device.type} ({date})", "",
             f"Medians of {args.repeats} alternating measurements after {args.warmup} warm-up; "
             f"{meta['machine'].get('cores')} cores ({meta['threads']} torch threads), torch {torch.__version__}, "
             f"{meta['dtype']}. Baseline: one causal "
             f"SDPA over the whole row (attention), the same rows without position ids (step).", "",
             "| documents per row | documents | SDPA calls | attention fwd+bwd s | / whole row | step s | / without |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        a, s = r["attention"], r["step"]
        lines.append(f"| {r['mix']} | {r['documents']} | {a['sdpa_calls']} | {a['documents_s']:.4f} | "
                     f"{a['ratio']:.2f}x | {s['documents_s']:.4f} | {s['ratio']:.3f}x |")
    stem = write_report(os.path.join(args.out, f"{date}_{device.type}_document_attention"), meta, lines, indent=1)
    print(f"plot: {plot(results, stem + '.png')}", file=sys.stderr)


def plot(results: list[dict], path: str) -> str:
    def draw(ax) -> None:
        names = [r["mix"] for r in results]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [r["attention"]["ratio"] for r in results], 0.4, label="attention fwd+bwd")
        ax.bar([i + 0.2 for i in x], [r["step"]["ratio"] for r in results], 0.4, label="training step")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(list(x), names, rotation=15, ha="right", fontsize=8)
        ax.set_ylabel("time / without documents")
        ax.legend()

    return figure(path, (8, 4), draw, dpi=120)


if __name__ == "__main__":
    main()
