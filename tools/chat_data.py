"""Chat and instruction records as training documents: token ids, and labels on the assistant's tokens only.

[Note: chat data]
A record is chat data when it has ``messages`` (a list of ``{"role", "content"}``) or ``prompt`` and
``completion`` (each a string, or a list of messages as TRL accepts). It is rendered to text with the
chat template of the tokenizer's directory (``chat_template.jinja``, else ``tokenizer_config.json``'s
``chat_template``), compiled as transformers compiles it: a jinja2 sandboxed environment with
``trim_blocks``/``lstrip_blocks``, the ``tojson`` filter, ``raise_exception`` and ``strftime_now``,
the special tokens (``bos_token``, ``eos_token``, ...) as variables, and ``{% generation %}`` blocks
marking the assistant's text. The text is tokenized whole, without added special tokens, as
``apply_chat_template(..., tokenize=True)`` does.

Labels (``train_on="completion"``, TRL's ``completion_only_loss``) are -100 everywhere except:

- ``messages``: the characters inside ``{% generation %}`` blocks, mapped to tokens exactly as
  ``return_assistant_tokens_mask=True`` maps them. A template without those blocks: each assistant
  message's text, found as what rendering the conversation up to that message adds to the rendering
  up to the message before it with the generation prompt.
- ``prompt``/``completion``: the tokens after the prompt's own tokens (as TRL counts them); a prompt
  made of messages is rendered with the generation prompt, so the assistant header stays unlabelled.

``train_on="all"`` labels every token. Without a chat template (the byte tokenizer, or a tokenizer
with none) messages are rendered in the plain format ``FALLBACK_FORMAT`` describes; string prompts and
completions are never templated (the text is ``prompt + completion``).
"""
from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from .packing import IGNORE_INDEX
from .train_config import TRAIN_ON_CHOICES, TrainConfigError

# The plain format used when the tokenizer has no chat template: every message as "<|role|>\n" + content + "\n";
# the assistant's content and its newline are the labelled part; the generation prompt is "<|assistant|>\n".
FALLBACK_FORMAT = "<|{role}|>\n{content}\n"
# The roles a chat record's messages may have (the chat templates' and OpenAI's): any other is refused,
# naming the role, the file and the line, rather than rendered into something no label marks.
ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")
TEMPLATE_FILE = "chat_template.jinja"


def is_chat(record: Any) -> bool:
    """A record shaped as chat data (see [Note: chat data])."""
    return isinstance(record, Mapping) and ("messages" in record or ("prompt" in record and "completion" in record))


class ChatFormat:
    """Renders chat records with the tokenizer's chat template (or the plain format) and labels them."""

    def __init__(self, tokenizer: Any, train_on: str = "completion") -> None:
        if train_on not in TRAIN_ON_CHOICES:
            raise TrainConfigError(f"train_on={train_on!r} is not one of {', '.join(TRAIN_ON_CHOICES)}")
        self.tokenizer = tokenizer
        self.train_on = train_on
        directory = getattr(tokenizer, "directory", None)
        source, self.special_tokens = _read_template(directory) if directory else (None, {})
        self.template = compile_template(source) if source else None
        self.has_generation_blocks = bool(source) and _uses_generation_tag(source)

    def encode(self, record: Mapping[str, Any], where: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, labels) of one record, each 1-D int64. ``where`` names the record in errors (path and line)."""
        if "messages" in record:
            messages = _messages(record["messages"], where, "messages")
            if self.train_on == "all":
                ids = self.tokenizer.encode(self.render(messages, where))
                mask = [1] * len(ids)
            else:
                text, spans = self._render_with_spans(messages, where)
                ids, offsets = self.tokenizer.encode_offsets(text)
                mask = spans_to_token_mask(spans, offsets)
        else:
            prompt, completion = record["prompt"], record["completion"]
            if isinstance(prompt, str) and isinstance(completion, str):
                prompt_ids = self.tokenizer.encode(prompt)
                ids = self.tokenizer.encode(prompt + completion)
            elif isinstance(prompt, list) and isinstance(completion, list):
                prompt_msgs = _messages(prompt, where, "prompt")
                all_msgs = prompt_msgs + _messages(completion, where, "completion")
                prompt_ids = self.tokenizer.encode(self.render(prompt_msgs, where, add_generation_prompt=True))
                ids = self.tokenizer.encode(self.render(all_msgs, where))
            else:
                raise TrainConfigError(f"data: {where}: prompt and completion must both be strings or both be lists "
                                       f"of {{role, content}} messages")
            mask = [0] * min(len(prompt_ids), len(ids)) + [1] * max(len(ids) - len(prompt_ids), 0)
        ids_arr = np.asarray(ids, dtype=np.int64)
        labels = ids_arr.copy()
        if self.train_on == "completion":
            labels[np.asarray(mask, dtype=bool) == 0] = IGNORE_INDEX
        return ids_arr, labels

    def render(self, messages: list[dict], where: str, add_generation_prompt: bool = False) -> str:
        if self.template is None:
            text = "".join(FALLBACK_FORMAT.format(role=m["role"], content=_text(m)) for m in messages)
            return text + ("<|assistant|>\n" if add_generation_prompt else "")
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except Exception as e:  # jinja2's TemplateError family, or an error raised inside the template
            raise TrainConfigError(f"data: {where}: the chat template cannot render this record "
                                   f"({_one_line(e)}); fix the record") from None

    def _render_with_spans(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The text and the character spans of the assistant's part."""
        if self.template is None:
            text, spans = "", []
            for m in messages:
                header = FALLBACK_FORMAT.format(role=m["role"], content="\0").split("\0")[0]
                piece = FALLBACK_FORMAT.format(role=m["role"], content=_text(m))
                if m["role"] == "assistant":
                    spans.append((len(text) + len(header), len(text) + len(piece)))
                text += piece
            return text, spans
        if self.has_generation_blocks:
            blocks: list[str] = []
            spans = []
            try:
                with self.template.environment.activate_tracker(blocks, spans):
                    for block in self.template.generate(messages=messages, add_generation_prompt=False,
                                                        **self.special_tokens):
                        blocks.append(block)
            except Exception as e:
                raise TrainConfigError(f"data: {where}: the chat template cannot render this record "
                                       f"({_one_line(e)}); fix the record") from None
            return "".join(blocks), spans
        text = self.render(messages, where)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._generation_prompt_after(messages[:i], where)
            upto = self.render(messages[:i + 1], where)
            if not (text.startswith(upto) and upto.startswith(before)):
                raise TrainConfigError(f"data: {where}: the chat template renders earlier turns differently as the "
                                       f"conversation grows, so the assistant's text cannot be located; use a template "
                                       f"with {{% generation %}} blocks, or --train-on all")
            spans.append((len(before), len(upto)))
        return text, spans


    def _generation_prompt_after(self, messages: list[dict], where: str) -> str:
        """``messages`` rendered with the generation prompt (a template may refuse an empty conversation: "")."""
        try:
            return self.render(messages, where, add_generation_prompt=True)
        except TrainConfigError:
            if messages:
                raise
            return ""


def spans_to_token_mask(spans: Sequence[tuple[int, int]], offsets: Sequence[tuple[int, int]]) -> list[int]:
    """1 on the tokens covering character spans [start, end), mapped as transformers maps assistant masks."""
    mask = [0] * len(offsets)
    for start, end in spans:
        first, last = _char_to_token(offsets, start), _char_to_token(offsets, end - 1)
        if first is None:
            break
        for t in range(first, last + 1 if last else len(offsets)):
            mask[t] = 1
    return mask


def _char_to_token(offsets: Sequence[tuple[int, int]], pos: int) -> int | None:
    """The first token whose character offsets hold ``pos`` (the ``tokenizers`` Encoding's rule)."""
    for i, (start, end) in enumerate(offsets):
        if start <= pos < end:
            return i
    return None


def compile_template(source: str) -> Any:
    """A jinja2 template compiled as transformers compiles chat templates (see [Note: chat data])."""
    try:
        import jinja2
        from jinja2 import nodes
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise TrainConfigError("data: rendering a chat template needs jinja2; pip install jinja2 (in the train "
                               "extra)") from None

    class AssistantTracker(Extension):
        """``{% generation %}...{% endgeneration %}``: records the character span its body renders to."""

        tags = {"generation"}

        def __init__(self, environment: Any) -> None:
            super().__init__(environment)
            environment.extend(activate_tracker=self.activate_tracker)
            self._rendered_blocks: list[str] | None = None
            self._generation_indices: list[tuple[int, int]] | None = None

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation_support(self, context: Any, caller: Any) -> str:
            rv = caller()
            if self._rendered_blocks is not None and self._generation_indices is not None:
                start = len("".join(self._rendered_blocks))
                self._generation_indices.append((start, start + len(rv)))
            return rv

        @contextmanager
        def activate_tracker(self, rendered_blocks: list[str], generation_indices: list) -> Iterator[None]:
            self._rendered_blocks, self._generation_indices = rendered_blocks, generation_indices
            try:
                yield
            finally:
                self._rendered_blocks = self._generation_indices = None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[AssistantTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TrainConfigError(f"tokenizer: the chat template does not parse ({e.message}, line {e.lineno}); fix "
                               f"chat_template in tokenizer_config.json") from None


def _uses_generation_tag(source: str) -> bool:
    return re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None


def _read_template(directory: str) -> tuple[str | None, dict[str, Any]]:
    """The chat template of a tokenizer directory and its special tokens as template variables."""
    config: dict[str, Any] = {}
    special: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise TrainConfigError(f"tokenizer: cannot read {path} ({_one_line(e)}); fix or remove the file") from None
        if not isinstance(data, dict):
            continue
        if name == "tokenizer_config.json":
            config = data
        for key, value in data.items():
            if key.endswith("_token") and isinstance(value, dict):
                value = value.get("content")
            if key.endswith("_token") and isinstance(value, str):
                special[key] = value
            elif key == "additional_special_tokens" and isinstance(value, list):
                special[key] = [v.get("content") if isinstance(v, dict) else v for v in value]
    template_file = os.path.join(directory, TEMPLATE_FILE)
    if os.path.isfile(template_file):
        with open(template_file, encoding="utf-8") as f:
            return f.read(), special
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return (template if isinstance(template, str) and template else None), special


def _messages(value: Any, where: str, field: str) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                              and "content" in m for m in value):
        raise TrainConfigError(f"data: {where}: {field} must be a list of {{\"role\": ..., \"content\": ...}} objects")
    for m in value:
        if m["role"] not in ROLES:
            raise TrainConfigError(f"data: {where}: unknown role {m['role']!r} in {field}; use one of "
                                   f"{', '.join(ROLES)}")
        if not isinstance(m["content"], str):  # never trained as the text "5" or "null"
            raise TrainConfigError(f"data: {where}: the {m['role']} message's content in {field} is "
                                   f"{json.dumps(m['content'], ensure_ascii=False)[:40]}, not a string; write the "
                                   f"message's text as a string")
    return value


def _text(message: Mapping[str, Any]) -> str:
    return message["content"]  # a string (checked by _messages)


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
