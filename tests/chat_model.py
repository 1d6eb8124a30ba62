"""Small real chat artifacts for tests: a byte-level BPE tokenizer trained with `tokenizers`, a ChatML chat
template with {% generation %} blocks in tokenizer_config.json, and a tiny Llama saved by transformers."""
from __future__ import annotations

import json
import os

# ChatML, as Qwen and SmolLM write it, with the assistant's text (and its end marker) in a generation block.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The same conversation format without generation blocks (the assistant's text is found by rendering prefixes).
PLAIN_CHATML = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

RECORDS = [
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "What is two plus two?"},
                  {"role": "assistant", "content": "Four."},
                  {"role": "user", "content": "And times three?"},
                  {"role": "assistant", "content": "Twelve, é ü."}]},
    {"messages": [{"role": "user", "content": "Name a colour"},
                  {"role": "assistant", "content": " Blue  with spaces "}]},
    {"prompt": [{"role": "user", "content": "Say hi"}], "completion": [{"role": "assistant", "content": "hi"}]},
    {"prompt": "The capital of France is", "completion": " Paris."},
]


def corpus_text() -> list[str]:
    from pydoc_data import topics

    return [topics.topics[k] for k in sorted(topics.topics)[:40]] + [
        json.dumps(r) for r in RECORDS]


def write_tokenizer(directory: str, template: str | None = CHAT_TEMPLATE, vocab_size: int = 300) -> str:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json in ``directory``; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_text(), trainer)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 128}
    if template is not None:
        config["chat_template"] = template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(directory, "special_tokens_map.json"), "w") as f:
        json.dump({k: config[k] for k in ("bos_token", "eos_token", "pad_token")}, f)
    return directory


def train_two_steps(model: str, root: str, out: str) -> None:
    """``megatrain-train`` on ``model`` (with its tokenizer.json) over RECORDS x 4 written to ROOT/chat.jsonl: two
    fp32 steps of 2 x 32 tokens into ``out``; asserts it exits 0."""
    from megatrain.tools import train

    data = os.path.join(root, "chat.jsonl")
    with open(data, "w") as f:
        f.write("\n".join(json.dumps(r) for r in RECORDS * 4) + "\n")
    assert train.main(["--model", model, "--tokenizer", os.path.join(model, "tokenizer.json"), "--data", data,
                       "--out", out, "--seq-len", "32", "--batch", "2", "--steps", "2", "--progress", "none",
                       "--no-plot", "--warmup-steps", "1", "--compute-dtype", "fp32"]) == 0


def write_model(directory: str, vocab_size: int) -> str:
    """A tiny random Llama saved by transformers (safetensors) in ``directory``, and its generation config."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(directory)
    GenerationConfig(bos_token_id=0, eos_token_id=2, max_new_tokens=8).save_pretrained(directory)
    return directory
