"""Chat records for supervised fine-tuning: a conversation rendered with a tokenizer directory's chat template
and tokenized to the ids of transformers' `apply_chat_template(messages, tokenize=True)`, with a loss mask that
is True on the assistant turns. transformers is not imported (seconds and hundreds of MB in every data worker):
the template is rendered as transformers 5.x renders it (utils/chat_template_utils.py), in a jinja2
ImmutableSandboxedEnvironment (templates come from model directories: untrusted code) with trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that neither escapes HTML nor
ASCII-fies, and `{% generation %}` accepted as its body (the mask comes from prefix renders, so templates
without those tags get one too). tests/unit/test_chat.py compares the ids with transformers itself.
"""
from __future__ import annotations

import bisect
import contextlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may come under; transformers copies the first present one to
# "thinking" and "reasoning_content" (the names templates read), and so do we, or the ids would differ.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class ChatError(ValueError):
    """A record that cannot be rendered: str(e) is the problem in words (e.g. "has no assistant turn",
    "messages[2] has no 'content'", "the chat template failed: <jinja's message>")."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tags) renders as its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)  # the tag's name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _SafeNamespace(jinja2.utils.Namespace):
    # transformers hardens the sandbox by refusing underscore names on namespace() objects; refusing the
    # same keeps a template that transformers would not run from running here.
    def __init__(*args, **kwargs):  # jinja's signature, so that namespace(self=...) still works
        attrs = dict(*args[1:], **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(args[0], attrs)

    def __setitem__(self, name, value):
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes <, >, & and ' for HTML; chat templates expect plain JSON (as transformers gives)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, namespace=_SafeNamespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatError(f"the chat template does not parse: {e}") from e


def token_text(value) -> str:
    """A special token from tokenizer_config.json: a string, an AddedToken dict ({"content": ...}) or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


@dataclass(frozen=True)
class ChatTemplate:
    source: str      # the template text
    bos_token: str   # "" when none
    eos_token: str
    # Compiled once per instance (a jinja compile costs ~ms; a record with k assistant turns renders 2k+1 times), left out of
    # equality, hashing and pickling (a compiled Template does not pickle; data workers receive copies).
    _template: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_template", _compile(self.source))

    def __getstate__(self):
        return {"source": self.source, "bos_token": self.bos_token, "eos_token": self.eos_token}

    def __setstate__(self, state):
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    @classmethod
    def from_dir(cls, directory) -> ChatTemplate | None:
        """A tokenizer directory's chat template, or None. As in transformers' from_pretrained, chat_template.jinja
        (what save_pretrained writes) wins over tokenizer_config.json's (a string or [{"name", "template"}])."""
        directory = Path(directory)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        jinja_path = directory / "chat_template.jinja"
        source = jinja_path.read_text(encoding="utf-8") if jinja_path.is_file() else config.get("chat_template")
        if isinstance(source, list):  # several named templates: transformers uses "default" (without tools)
            source = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if isinstance(source, dict):
            if "default" not in source:
                raise ChatError(f"{config_path} has several chat templates and none named 'default'")
            source = source["default"]
        if not source:
            return None
        if not isinstance(source, str):
            raise ChatError(f"{config_path}: chat_template is not a string")
        return cls(source, token_text(config.get("bos_token")), token_text(config.get("eos_token")))

    def render(self, messages, add_generation_prompt=False) -> str:
        return self._render(_checked(messages, allow_empty=True), add_generation_prompt)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        # transformers passes the tokenizer's special tokens that are set (an unset one stays undefined
        # for the template) and tools / documents as None.
        tokens = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token)) if v}
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **tokens)
        except Exception as e:  # anything raised here is the template failing on this record
            raise ChatError(f"the chat template failed: {e}") from e


def _checked(messages, allow_empty: bool = False) -> list[dict]:
    """Copies of the messages as transformers gives them to the template (None values dropped,
    reasoning aliased), or ChatError naming what is wrong."""
    if not isinstance(messages, (list, tuple)):
        raise ChatError(f"messages is not a list (it is {type(messages).__name__})")
    if not messages and not allow_empty:
        raise ChatError("messages is empty")
    plain = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatError(f"messages[{i}] is not an object (it is {type(message).__name__})")
        for key in ("role", "content"):
            if message.get(key) is None:
                raise ChatError(f"messages[{i}] has no '{key}'")
            if not isinstance(message[key], str):
                raise ChatError(f"messages[{i}]'s '{key}' is not a string")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        plain.append(message)
    return plain


@contextlib.contextmanager
def _plain_encoding(tok):
    """The tokenizer as apply_chat_template uses it: special tokens in the text parsed as special, no
    truncation or padding. prepare.py sets encode_special_tokens=True on its tokenizer, so the caller's
    settings are put back afterwards (so one tokenizer must not be shared by threads encoding at once)."""
    special, truncation, padding = tok.encode_special_tokens, tok.truncation, tok.padding
    tok.encode_special_tokens = False
    tok.no_truncation(), tok.no_padding()
    try:
        yield tok
    finally:
        tok.encode_special_tokens = special
        if truncation is not None:
            tok.enable_truncation(**truncation)
        if padding is not None:
            tok.enable_padding(**padding)


def encode_chat(tok, template: ChatTemplate, messages) -> tuple[list[int], list[bool]]:
    """ids of the rendered conversation and, per id, whether it is assistant content (carries loss).

    Assistant message i spans the characters between the render of messages[:i] with the generation
    prompt and the render of messages[:i+1] (its content and whatever the template closes it with, e.g.
    "<|im_end|>\\n"); a token carries loss when its first character lies in such a span."""
    messages = _checked(messages)
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistants:
        raise ChatError("has no assistant turn")
    text = template._render(messages, False)
    spans = []
    for i in assistants:
        before = template._render(messages[:i], True)
        through = template._render(messages[: i + 1], False)
        previous_end = spans[-1][1] if spans else 0
        if not (text.startswith(before) and text.startswith(through) and previous_end <= len(before) <= len(through)):
            raise ChatError(f"the chat template is not incremental: the render up to messages[{i}] is not a "
                            "prefix of the whole conversation's, so its assistant tokens cannot be located")
        spans.append((len(before), len(through)))
    with _plain_encoding(tok):
        encoding = tok.encode(text, add_special_tokens=False)
    # spans are sorted and disjoint: a token is in the last span starting at or before it, or in none
    starts = [lo for lo, _ in spans]
    mask = [(k := bisect.bisect_right(starts, start) - 1) >= 0 and start < spans[k][1] for start, _ in encoding.offsets]
    return list(encoding.ids), mask


def chat_files(tokenizer_path) -> dict[str, Path]:
    """The files of a tokenizer's directory that hold its chat template and special tokens: a checkpoint
    keeps them beside its tokenizer.json, so that an export serves chats as the model was tuned on them."""
    directory = Path(tokenizer_path).parent
    return {name: directory / name for name in ("tokenizer_config.json", "chat_template.jinja") if (directory / name).is_file()}
