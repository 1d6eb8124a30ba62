"""megatrain-train against TRL's SFTTrainer on the same chat fine-tune: per-step loss, step time, padding.

    pip install trl            # not a megatrain dependency
    python benchmarks/trl_parity.py [--steps 60] [--records 480] [--seq-len 256] [--batch 8] [--lr 1e-4]

The same tiny Qwen2-shaped model saved by transformers (random init, seed 0), the same byte-level BPE tokenizer
with a ChatML template whose assistant turns are {% generation %} blocks (tests/chat_model.py), the same
chat records (pydoc topics as answers), assistant-only loss, fp32 on the CPU, AdamW (betas 0.9/0.95,
eps 1e-8, no weight decay, gradient clipping at 1.0), a constant learning rate, no shuffling (megatrain
--no-shuffle; TRL with a sequential sampler), so the two read the same conversations in the same order.

Two layouts, each compared step by step (the goal: per-step losses within 1e-5):

- ``rows``: one conversation per row (megatrain --packing none; TRL packing=False, its own tokenization and
  assistant masks): the batches are the same tokens.
- ``packed``: whole-conversation packing (megatrain --packing whole, best-fit-decreasing). TRL's own ``bfd``
  packing fills other rows (other windows, another row order), so TRL is given megatrain's rows instead
  (trl_rows.py): built by the calls megatrain-train makes, each a TRL example with its documents' lengths
  (``seq_lengths``), trained padding-free (TRL flattens a batch into one sequence and restarts the position
  ids at each document, and transformers keeps attention within each document, checked before the runs:
  per-token losses of the packed documents against each run alone, and, as the control that the check can
  fail, with the position ids left out). The results say whether megatrain trained exactly those rows
  (labelled tokens per step, padding fraction).

Writes benchmarks/results/<date>_cpu_trl_parity[_<layouts>].{json,md} (the layouts named when not both).
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
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the chat tokenizer and template of the tests

import trl_rows  # noqa: E402
from result_files import machine, write_report  # noqa: E402


def build(work: str, records: int, vocab: int) -> tuple[str, str]:
    """The model directory (tokenizer + tiny Qwen2) and the chat.jsonl; returns both paths."""
    import torch
    from pydoc_data import topics
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from chat_model import write_tokenizer

    model = write_tokenizer(os.path.join(work, "model"), vocab_size=vocab)
    # transformers builds a Qwen2Tokenizer for a qwen2 directory (its own pre-tokenizer: other ids than this
    # tokenizer.json, which megatrain-train refuses at start): saved by transformers, both read the same one.
    from transformers import AutoTokenizer

    Qwen2Config(vocab_size=vocab).save_pretrained(model)
    AutoTokenizer.from_pretrained(model).save_pretrained(model)
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                 tie_word_embeddings=False, bos_token_id=0, eos_token_id=2)).save_pretrained(model)
    names = sorted(topics.topics)
    data = os.path.join(work, "chat.jsonl")
    with open(data, "w") as f:
        for i in range(records):
            name, text = names[i % len(names)], topics.topics[names[i % len(names)]]
            start = (i * 37) % max(len(text) - 400, 1)
            answer = " ".join(text[start:start + 60 + (i * 53) % 340].split())
            messages = [{"role": "user", "content": f"What is {name}?"}, {"role": "assistant", "content": answer}]
            if i % 3 == 0:
                messages = [{"role": "system", "content": "Answer from the Python docs."}] + messages
            if i % 4 == 1:
                messages += [{"role": "user", "content": "Shorter?"}, {"role": "assistant", "content": answer[:40]}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return model, data


def megatrain_options(model: str, data: str, out: str, a: argparse.Namespace, packing: str) -> list[str]:
    """megatrain-train's options for a run: the same for the run and for the rows handed to TRL."""
    return ["--model", model, "--data", data, "--out", out,
            "--packing", packing, "--no-shuffle", "--seq-len", str(a.seq_len), "--batch", str(a.batch),
            "--steps", str(a.steps), "--lr", str(a.lr), "--min-lr", str(a.lr), "--warmup-steps", "0",
            "--weight-decay", "0", "--beta1", "0.9", "--beta2", "0.95", "--max-grad-norm", "1.0",
            "--compute-dtype", "fp32", "--device", "cpu", "--progress", "none", "--no-plot", "--seed", "0"]


def run_megatrain(options: list[str], out: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "megatrain.tools.train", *options], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"megatrain-train failed: {proc.stderr.strip().splitlines()[-1]}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    summary = json.load(open(os.path.join(out, "summary.json")))
    return {"loss": [r["loss"] for r in rows], "step_time_s": [r["step_time_s"] for r in rows],
            "positions": [r["step_tokens"] for r in rows], "trained_tokens": [r["step_trained_tokens"] for r in rows],
            "padding_fraction": summary["packing"]["padding_fraction"]}


def run_trl(model: str, data: str, out: str, a: argparse.Namespace, rows=None) -> dict:
    """TRL's SFTTrainer on the chat records, one conversation per row (``rows`` None), or on ``rows``, a dataset
    of megatrain's packed rows (trl_rows.trl_dataset), padding-free, so that both train on the same rows."""
    import torch
    from datasets import load_dataset
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    losses: list[float] = []
    times: list[float] = []
    positions: list[int] = []
    padding: list[int] = []
    trained: list[int] = []

    class Recording(SFTTrainer):
        def _get_train_sampler(self, *args, **kwargs):  # the records in file order, as megatrain --no-shuffle
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ids = inputs["input_ids"]
            mask = inputs.get("attention_mask")
            positions.append(int(ids.numel()))
            padding.append(int((mask == 0).sum()) if mask is not None else 0)
            trained.append(int((inputs["labels"][:, 1:] != -100).sum()))
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            losses.append(float((loss[0] if return_outputs else loss).detach()))
            return loss

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.t0)

    torch.manual_seed(0)
    if rows is None:  # TRL tokenizes the records, assistant tokens labelled, one per row, padded per batch
        layout = {"max_length": a.seq_len, "assistant_only_loss": True, "packing": False}
        dataset = load_dataset("json", data_files=data, split="train")
    else:  # the rows as they are (labels given): flattened per batch, documents told apart by their position ids
        layout = {"max_length": None, "padding_free": True, "packing": False,
                  "dataset_kwargs": {"skip_prepare_dataset": True}}
        dataset = rows
    config = SFTConfig(output_dir=out, per_device_train_batch_size=a.batch, max_steps=a.steps,
                       learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                       adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0, logging_steps=1,
                       save_strategy="no", report_to=[], use_cpu=True, seed=0, bf16=False, fp16=False,
                       dataloader_num_workers=0, **layout)
    trainer = Recording(model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32,
                                                                   attn_implementation="sdpa"),
                        args=config, train_dataset=dataset,
                        processing_class=AutoTokenizer.from_pretrained(model), callbacks=[Timer()])
    trainer.train()
    total = sum(positions)
    return {"loss": losses, "step_time_s": times, "positions": positions, "trained_tokens": trained,
            "padding_fraction": sum(padding) / total if total else 0.0}


def compare(m: dict, t: dict) -> dict:
    diffs = [abs(x - y) for x, y in zip(m["loss"], t["loss"])]
    return {"steps": min(len(m["loss"]), len(t["loss"])), "max_abs_loss_diff": max(diffs),
            "mean_abs_loss_diff": statistics.fmean(diffs),
            "mean_loss": {"megatrain": statistics.fmean(m["loss"]), "trl": statistics.fmean(t["loss"])},
            "first_last_loss": {"megatrain": [m["loss"][0], m["loss"][-1]], "trl": [t["loss"][0], t["loss"][-1]]},
            "same_trained_tokens": m["trained_tokens"] == t["trained_tokens"],
            "median_step_s": {"megatrain": statistics.median(m["step_time_s"][1:]),
                              "trl": statistics.median(t["step_time_s"][1:])},
            "padding_fraction": {"megatrain": m["padding_fraction"], "trl": t["padding_fraction"]},
            "positions_per_step": {"megatrain": statistics.fmean(m["positions"]),
                                   "trl": statistics.fmean(t["positions"])}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--records", type=int, default=480)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--layouts", default="rows,packed")
    a = p.parse_args()
    import trl

    load_before = os.getloadavg()
    results: dict = {"date": datetime.date.today().isoformat(), "machine": machine(), "trl": trl.__version__,
                     "command": " ".join(["python benchmarks/trl_parity.py", *sys.argv[1:]]), "args": vars(a),
                     "load_average_before": load_before, "layouts": {}}
    with tempfile.TemporaryDirectory() as work:
        model, data = build(work, a.records, a.vocab)
        for layout in a.layouts.split(","):
            out = os.path.join(work, f"mt-{layout}")
            options = megatrain_options(model, data, out, a, "none" if layout == "rows" else "whole")
            entry: dict = {}
            rows = None
            if layout == "packed":  # TRL trains on megatrain's rows: see trl_rows.py
                steps_rows, padding = trl_rows.megatrain_rows(options, a.steps)
                rows = trl_rows.trl_dataset(steps_rows)
                entry["rows_given_to_trl"] = {
                    "padding_fraction": padding,
                    "trained_tokens": [sum(int((r["labels"][1:] != -100).sum()) for r in g) for g in steps_rows]}
                entry["document_attention_check"] = trl_rows.check_document_attention(model, rows, a.batch)
                print("document attention", json.dumps(entry["document_attention_check"]), flush=True)
            m = run_megatrain(options, out)
            t = run_trl(model, data, os.path.join(work, f"trl-{layout}"), a, rows)
            entry = {"summary": compare(m, t), **entry, "megatrain": m, "trl": t}
            if rows is not None:  # megatrain trained on the rows handed to TRL
                entry["summary"]["megatrain_trained_the_rows_given_to_trl"] = (
                    m["trained_tokens"] == entry["rows_given_to_trl"]["trained_tokens"]
                    and abs(m["padding_fraction"] - entry["rows_given_to_trl"]["padding_fraction"]) < 1e-12)
            results["layouts"][layout] = entry
            print(layout, json.dumps(entry["summary"]), flush=True)
    results["load_average_after"] = os.getloadavg()
    suffix = "" if a.layouts == "rows,packed" else "_" + a.layouts.replace(",", "_")
    write_report(os.path.join(HERE, "results", f"{results['date']}_cpu_trl_parity{suffix}"), results,
                 markdown(results), indent=1)


def markdown(r: dict) -> str:
    a = r["args"]
    lines = [f"# megatrain-train vs TRL {r['trl']} SFTTrainer: chat fine-tune parity, cpu ({r['date']})", "",
             f"`{r['command']}`", "",
             f"Tiny Qwen2-shaped model (hidden 128, 4 layers, vocab {a['vocab']}, random init saved by transformers), "
             f"{a['records']} chat records, assistant-only loss, {a['steps']} steps of {a['batch']} x {a['seq_len']}, "
             f"lr {a['lr']:g} constant, AdamW 0.9/0.95, no weight decay, clipping 1.0, fp32, no shuffling. "
             f"{r['machine']['cores']} cores, torch {r['machine']['torch']}; load average "
             f"{r['load_average_before'][0]:.1f} before, {r['load_average_after'][0]:.1f} after (1 min): "
             f"a shared machine, so step times are noisy.", "",
             "| layout | steps | max abs loss diff | mean abs loss diff | loss at the first / last step (megatrain) "
             "| mean loss megatrain / TRL | same labelled tokens per step | median step s megatrain / TRL "
             "| padding fraction megatrain / TRL | positions per step megatrain / TRL |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for layout, v in r["layouts"].items():
        s = v["summary"]
        lines.append(f"| {layout} | {s['steps']} | {s['max_abs_loss_diff']:.2e} | {s['mean_abs_loss_diff']:.2e} | "
                     f"{s['first_last_loss']['megatrain'][0]:.4f} / {s['first_last_loss']['megatrain'][1]:.4f} | "
                     f"{s['mean_loss']['megatrain']:.6f} / {s['mean_loss']['trl']:.6f} | {s['same_trained_tokens']} | "
                     f"{s['median_step_s']['megatrain']:.3f} / {s['median_step_s']['trl']:.3f} | "
                     f"{s['padding_fraction']['megatrain']:.3f} / {s['padding_fraction']['trl']:.3f} | "
                     f"{s['positions_per_step']['megatrain']:.0f} / {s['positions_per_step']['trl']:.0f} |")
    lines += ["", "`rows`: one conversation per row on both sides (megatrain `--packing none`, TRL `packing=False` "
              "with its own tokenization and assistant masks): the same tokens in every batch. megatrain pads "
              "every row to --seq-len; TRL pads each batch to its longest conversation."]
    packed = r["layouts"].get("packed")
    if packed:
        c, s = packed["document_attention_check"], packed["summary"]
        lines.append(
            "`packed`: whole-conversation packing, the same rows on both sides. The rows are megatrain's "
            "(`--packing whole`, best-fit-decreasing), built by the calls megatrain-train makes "
            "(benchmarks/trl_rows.py); each is handed to TRL as one example (its tokens and labels without the "
            "row's padding, and `seq_lengths`, its documents' lengths), trained padding-free: TRL's collator "
            "flattens a batch's 8 rows into one sequence with position ids restarting at each document, and "
            "transformers (sdpa) keeps attention within each document from those position ids. Checked on the "
            f"first batch ({c['documents']} documents, {c['tokens']} tokens): per-token losses packed vs each "
            f"document alone differ by at most {c['max_abs_token_loss_diff_packed_vs_alone']:.1e} "
            f"({c['max_abs_token_loss_diff_without_position_ids']:.2f} with the position ids left out, the "
            "control). megatrain trained exactly the rows given to TRL (the same labelled tokens in every step "
            f"and padding fraction): {s['megatrain_trained_the_rows_given_to_trl']}. TRL's own `bfd` packing "
            "would fill other rows (other windows, another row order), so it is not used. TRL's padding "
            "fraction is 0 since it drops the rows' padding; megatrain's rows are --seq-len long.")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
