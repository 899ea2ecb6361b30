"""data/chat.py: chat records rendered and tokenized to exactly the ids of transformers'
apply_chat_template(tokenize=True), with a loss mask on the assistant turns, without transformers at runtime.

The tokenizers are tiny byte-level BPEs trained here (no download) and saved by transformers'
save_pretrained, so ChatTemplate.from_dir reads what transformers writes. The comparisons with transformers
skip, with the reason printed, where it is not installed; the rest runs without it.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shardwise.data.chat import ChatError, ChatTemplate, encode_chat

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Meta's Llama 3 template, verbatim: the bos token is written with the first message only.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
          "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Qwen2.5-style: a default system message when the conversation has none; block tags on their own lines
# (trim_blocks / lstrip_blocks must remove them as transformers does); tojson and namespace().
SYSTEM = """{%- set ns = namespace(turns=0) %}
{%- for m in messages %}
    {%- if loop.first and m['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
    {%- if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('Unknown role ' + m['role']) }}{% endif %}
    {%- if m['role'] == 'user' %}{% set ns.turns = ns.turns + 1 %}{% endif %}
<|im_start|>{{ m['role'] }}
{{ m['content'] if m['role'] != 'system' else m['content'] | tojson }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
# ChatML with transformers' assistant-mask tags around the assistant content and its end marker.
GENERATION = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
              "{{ m['content'] }}<|im_end|>\n{% endgeneration %}{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
              "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CHATML_TOKENS = dict(specials=["<|im_start|>", "<|im_end|>"], bos=None, eos="<|im_end|>")
LLAMA3_TOKENS = dict(specials=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
                     bos="<|begin_of_text|>", eos="<|eot_id|>")
TEMPLATES = {"chatml": (CHATML, CHATML_TOKENS), "llama3": (LLAMA3, LLAMA3_TOKENS), "system": (SYSTEM, CHATML_TOKENS),
             "generation": (GENERATION, CHATML_TOKENS)}
# What each template writes after an assistant's content, inside its loss span.
CLOSERS = {"chatml": "<|im_end|>\n", "llama3": "<|eot_id|>", "system": "<|im_end|>\n", "generation": "<|im_end|>\n"}

CONVERSATIONS = [
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello world"}],
    [{"role": "system", "content": "Be brief, \"naïve\" <b>café</b>."},
     {"role": "user", "content": "héllo wörld 日本語 🙂"}, {"role": "assistant", "content": "日本語 🙂 fine thanks"},
     {"role": "user", "content": "how are you\ntoday?  "}, {"role": "assistant", "content": "  I am fine\n\nthanks  "}],
    [{"role": "user", "content": "what is <|im_end|> here?"}, {"role": "assistant", "content": "a marker: <|eot_id|>",
                                                               "tool_calls": None}],
]
CORPUS = ["hello world, how are you today? I am fine thanks.", "héllo wörld 日本語 🙂 naïve café", "user assistant system",
          "You are a helpful assistant. Be brief."] * 10


def _transformers():
    return pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def bpe() -> str:
    """A small byte-level BPE as JSON (each test adds its special tokens to a fresh copy)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok.to_str()


def _tok(bpe: str, specials) -> Tokenizer:
    tok = Tokenizer.from_str(bpe)
    tok.add_special_tokens(specials)
    return tok


def _save(directory: Path, bpe: str, template: str | None, specials, bos, eos, **save_kwargs) -> Path:
    """A PreTrainedTokenizerFast directory written by transformers' save_pretrained."""
    hf = _transformers().PreTrainedTokenizerFast(tokenizer_object=_tok(bpe, specials), bos_token=bos, eos_token=eos,
                                                 chat_template=template)
    hf.save_pretrained(directory, **save_kwargs)
    return directory


def _ours(directory: Path):
    return Tokenizer.from_file(str(directory / "tokenizer.json")), ChatTemplate.from_dir(directory)


def _runs(tok, ids, mask) -> list[str]:
    """The decoded text of each maximal run of loss-carrying ids."""
    runs, current = [], []
    for i, m in zip(ids + [None], mask + [False]):
        if m:
            current.append(i)
        elif current:
            runs.append(tok.decode(current, skip_special_tokens=False))
            current = []
    return runs


@pytest.mark.parametrize("name", TEMPLATES)
def test_ids_and_text_equal_transformers(tmp_path, bpe, name):
    transformers = _transformers()
    source, tokens = TEMPLATES[name]
    directory = _save(tmp_path, bpe, source, **tokens)
    assert (directory / "chat_template.jinja").is_file()  # what save_pretrained writes in this version
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    tok, template = _ours(directory)
    assert template == ChatTemplate(source, tokens["bos"] or "", tokens["eos"])
    tok.encode_special_tokens = True  # as prepare.py leaves its tokenizer: encode_chat must not be affected
    for messages in CONVERSATIONS:
        ids, mask = encode_chat(tok, template, messages)
        assert ids == hf.apply_chat_template(messages, tokenize=True, return_dict=False), messages
        assert len(mask) == len(ids)
        for prompt in (False, True):
            assert template.render(messages, prompt) == hf.apply_chat_template(messages, tokenize=False,
                                                                               add_generation_prompt=prompt)
    assert tok.encode_special_tokens is True  # the caller's setting is put back


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_mask_is_the_assistant_contents_and_their_closers(bpe, name):
    source, tokens = TEMPLATES[name]
    tok, template = _tok(bpe, tokens["specials"]), ChatTemplate(source, tokens["bos"] or "", tokens["eos"])
    for messages in CONVERSATIONS:
        ids, mask = encode_chat(tok, template, messages)
        strip = str.strip if name == "llama3" else str  # Llama 3's template trims every content
        expected = [strip(m["content"]) + CLOSERS[name] for m in messages if m["role"] == "assistant"]
        assert _runs(tok, ids, mask) == expected


def test_the_mask_equals_transformers_assistant_masks(tmp_path, bpe):
    transformers = _transformers()
    directory = _save(tmp_path, bpe, GENERATION, **CHATML_TOKENS)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    tok, template = _ours(directory)
    for messages in CONVERSATIONS:
        ids, mask = encode_chat(tok, template, messages)
        out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert out["input_ids"] == ids
        assert out["assistant_masks"] == [int(m) for m in mask]


def test_a_tokenizer_with_truncation_and_padding_encodes_whole_and_keeps_them(bpe):
    tok, template = _tok(bpe, CHATML_TOKENS["specials"]), ChatTemplate(CHATML, "", "<|im_end|>")
    whole, _ = encode_chat(tok, template, CONVERSATIONS[1])
    tok.enable_truncation(4)
    tok.enable_padding(length=200)
    assert encode_chat(tok, template, CONVERSATIONS[1])[0] == whole
    assert tok.truncation["max_length"] == 4 and tok.padding["length"] == 200


@pytest.mark.parametrize("messages, words", [
    ([{"role": "user", "content": "hi"}], "has no assistant turn"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}], "messages[1] has no 'content'"),
    ([{"content": "hi"}, {"role": "assistant", "content": "x"}], "messages[0] has no 'role'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ["x"]}], "messages[1]'s 'content' is not a string"),
    ([{"role": "user", "content": "hi"}, "assistant: x"], "messages[1] is not an object (it is str)"),
    ({"role": "user", "content": "hi"}, "messages is not a list (it is dict)"),
    ("user: hi", "messages is not a list (it is str)"),
    ([], "messages is empty"),
    ([{"role": "tool", "content": "hi"}, {"role": "assistant", "content": "x"}], "the chat template failed: Unknown role tool"),
])
def test_records_that_cannot_be_rendered(messages, words):
    with pytest.raises(ChatError) as caught:
        encode_chat(Tokenizer(models.BPE()), ChatTemplate(SYSTEM, "", "<|im_end|>"), messages)
    assert str(caught.value) == words


def test_a_template_that_is_not_incremental_or_does_not_parse():
    counted = ChatTemplate("{{ messages | length }}" + CHATML, "", "")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]
    with pytest.raises(ChatError, match="not incremental"):
        encode_chat(Tokenizer(models.BPE()), counted, messages)
    with pytest.raises(ChatError, match="the chat template does not parse: .*"):
        ChatTemplate("{% for m in messages %}", "", "")
    with pytest.raises(ChatError, match="the chat template failed: 'str object' has no attribute 'nope'"):
        ChatTemplate("{{ messages[0].content.nope() }}", "", "").render(messages)
    with pytest.raises(ChatError, match="the chat template failed: a namespace attribute may not start with '_'"):
        ChatTemplate("{% set ns = namespace(_x=1) %}", "", "").render(messages)


def test_reasoning_reaches_the_template_under_the_names_transformers_gives(tmp_path, bpe):
    transformers = _transformers()
    source = "{% for m in messages %}{{ m.role }}:{{ m.thinking }}|{{ m.reasoning_content }}|{{ m.content }}\n{% endfor %}"
    directory = _save(tmp_path, bpe, source, **CHATML_TOKENS)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "reasoning": "hmm", "thinking": None}]
    assert ChatTemplate.from_dir(directory).render(messages) == hf.apply_chat_template(messages, tokenize=False)
    assert "assistant:hmm|hmm|x" in ChatTemplate.from_dir(directory).render(messages)


def test_from_dir_reads_config_templates_and_token_forms(tmp_path):
    assert ChatTemplate.from_dir(tmp_path) is None  # an empty directory
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"eos_token": "</s>", "bos_token": None}))
    assert ChatTemplate.from_dir(tmp_path) is None  # a config without a template
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": CHATML}],
                                  "bos_token": {"content": "<s>", "lstrip": False, "special": True}, "eos_token": "</s>"}))
    assert ChatTemplate.from_dir(tmp_path) == ChatTemplate(CHATML, "<s>", "</s>")
    (tmp_path / "chat_template.jinja").write_text(LLAMA3, encoding="utf-8")  # the file wins over the config
    assert ChatTemplate.from_dir(tmp_path) == ChatTemplate(LLAMA3, "<s>", "</s>")
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}]}))
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ChatError, match="none named 'default'"):
        ChatTemplate.from_dir(tmp_path)


def test_from_dir_on_transformers_directories(tmp_path, bpe):
    assert ChatTemplate.from_dir(_save(tmp_path / "none", bpe, None, **CHATML_TOKENS)) is None
    legacy = _save(tmp_path / "legacy", bpe, LLAMA3, **LLAMA3_TOKENS, save_jinja_files=False)
    assert not (legacy / "chat_template.jinja").exists()
    assert ChatTemplate.from_dir(legacy) == ChatTemplate(LLAMA3, "<|begin_of_text|>", "<|eot_id|>")


def test_a_template_pickles_for_data_workers():
    template = ChatTemplate(CHATML, "", "<|im_end|>")
    copy = pickle.loads(pickle.dumps(template))
    assert copy == template
    messages = [{"role": "user", "content": "hi"}]
    assert copy.render(messages, add_generation_prompt=True) == template.render(messages, add_generation_prompt=True)
