"""Fine-tuning records: prompt / completion pairs and chat conversations, tokenized with a loss mask.

A record of a JSON-lines (or JSON array) file is one of
  {"prompt": "...", "completion": "..."}          the loss on the completion (and the end token after it)
  {"messages": [{"role": ..., "content": ...}]}   rendered with the tokenizer directory's chat template
                                                  (data/chat.py: the ids transformers' apply_chat_template
                                                  gives); the loss on the assistant turns
and data.format says which ("auto": the first record of the first file decides for the corpus).

A prepared fine-tuning shard stores each token as int32 with its loss flag in the sign: a token that
carries loss as its id t >= 0, one that does not (prompt, system and user turns, template markers) as
~t = -t - 1 < 0. The shards keep Megatron's indexed-dataset layout (one sequence per record), every path
that moves rows (loader workers, data-parallel slices, micro-batches, context-parallel splits) moves the
flag with the token, and train/data.py split_inputs_targets turns it into the inputs' ids and an ignored
target (IGNORE_INDEX, what F.cross_entropy and loss_parallel skip) at the last moment. The same corpus
serves data.loss_on = "all" (packing drops the flags, data/packing.py): the choice is a training
setting, not part of the prepared corpus's identity.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shardwise.data.corpus import file_kind
from shardwise.errors import ConfigError

FORMATS = ("auto", "text", "prompt_completion", "chat")
FINETUNE_FORMATS = ("prompt_completion", "chat")
LOSS_ON = ("all", "completion")
FINETUNE_DTYPE = np.dtype(np.int32)  # signed: the loss flag is the sign
IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index, which torch's loss_parallel honours too


def detect_format(files: list[Path]) -> str:
    """data.format = "auto": "chat" when the first record of the first file (a Parquet file's columns) has
    `messages`, "prompt_completion" when it has `prompt` and `completion`, else "text" (always for text files)."""
    if not files:
        return "text"
    kind = file_kind(files[0])
    if kind == "jsonl":
        with open(files[0], "rb") as f:
            for line in f:
                if line.strip():
                    try:
                        return _kind(json.loads(line))
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        return "text"  # the preparation names the bad line
    if kind == "parquet":
        import pyarrow.parquet as pq

        return _kind(dict.fromkeys(pq.ParquetFile(files[0]).schema_arrow.names, ""))
    if kind == "json":
        with open(files[0], encoding="utf-8", errors="replace") as f:
            head = f.read(1 << 20).lstrip()
        if head.startswith("["):
            try:
                return _kind(json.JSONDecoder().raw_decode(head[1:].lstrip())[0])
            except json.JSONDecodeError:
                return "text"
    return "text"


def _kind(record: object) -> str:
    if isinstance(record, dict):
        if "messages" in record:
            return "chat"
        if "prompt" in record and "completion" in record:
            return "prompt_completion"
    return "text"


def check_format(fmt: str, files: list[Path], field: str) -> None:
    """Fine-tuning records are read from JSON lines, JSON arrays and Parquet files (text files hold text)."""
    if fmt in FINETUNE_FORMATS:
        other = [f for f in files if file_kind(f) not in ("jsonl", "json", "parquet")]
        if other:
            raise ConfigError(field, f"data.format={fmt} reads JSON-lines, JSON or Parquet files, but {other[0]} is "
                              "a text file", "convert the records to JSON lines (one object a line), or set data.format=text")


def record_item(record: object, fmt: str, where, stats):
    """The record's fine-tuning item, checked: (prompt, completion) or the messages list; None (counted
    or raised by `stats`, data/records.py) when it is not one. `where()` names file and line."""
    found = (", ".join(map(str, record)) or "none") if isinstance(record, dict) else f"a JSON {type(record).__name__}"
    if fmt == "prompt_completion":
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) \
                or not isinstance(record.get("completion"), str):
            stats.bad_record(where(), f"has no string 'prompt' and 'completion' (found: {found})", "no_fields")
            return None
        if not record["completion"]:
            stats.empty += 1
            return None
        return record["prompt"], record["completion"]
    if not isinstance(record, dict) or "messages" not in record:
        stats.bad_record(where(), f"has no 'messages' list (found: {found})", "no_fields")
        return None
    return record["messages"]


def item_key(item) -> str:
    """What the held-out split hashes (data/holdout.py): the record's content, canonically."""
    return json.dumps(item, sort_keys=True, ensure_ascii=False)


class RecordEncoder:
    """Tokenizes fine-tuning items into signed ids (the sign is the loss flag) in a preparation worker, with
    the worker's tokenizer (data/prepare.py's, which reads special-token text in a prompt as text; a chat's
    markers are parsed as special tokens by encode_chat, which puts the setting back)."""

    def __init__(self, fmt: str, tok, tokenizer_dir: Path, eod: int):
        from shardwise.data.chat import ChatTemplate

        self.fmt, self.tok, self.eod = fmt, tok, eod
        self.template = ChatTemplate.from_dir(tokenizer_dir) if fmt == "chat" else None

    def encode(self, item, where, stats) -> np.ndarray | None:
        """The record's ids, ending with the end-of-document token; None for a bad record (`stats`)."""
        if self.fmt == "prompt_completion":
            prompt, completion = (e.ids for e in self.tok.encode_batch_fast(list(item), add_special_tokens=False))
            # The end token carries loss: it is how the model learns to stop after a completion.
            ids = np.array([*prompt, *completion, self.eod], dtype=np.int64)
            loss = np.zeros(len(ids), dtype=bool)
            loss[len(prompt):] = True
        else:
            from shardwise.data.chat import ChatError, encode_chat

            try:
                chat_ids, flags = encode_chat(self.tok, self.template, item)
            except ChatError as e:
                stats.bad_record(where(), str(e), "bad_chat")
                return None
            # The template ends each assistant turn with its own marker (which carries loss); the end
            # token after the conversation only separates it from the next record in a packed row.
            ids = np.array([*chat_ids, self.eod], dtype=np.int64)
            loss = np.array([*flags, False], dtype=bool)
        return np.where(loss, ids, ~ids).astype(FINETUNE_DTYPE)


def chat_template_check(tokenizer_path: Path, field: str = "data.tokenizer") -> None:
    """Before preparing chat records: the tokenizer's directory has a chat template."""
    from shardwise.data.chat import ChatError, ChatTemplate

    try:
        template = ChatTemplate.from_dir(Path(tokenizer_path).parent)
    except ChatError as e:  # compiled when read: a syntax error, or no "default" among named templates
        raise ConfigError(field, f"the chat template of {Path(tokenizer_path).parent}: {e}",
                          "repair the template (chat_template.jinja or tokenizer_config.json's chat_template)") from None
    if template is None:
        raise ConfigError(field, f"chat records need a chat template, and {Path(tokenizer_path).parent} has none "
                          "(no chat_template in tokenizer_config.json, no chat_template.jinja)",
                          "set data.tokenizer to the tokenizer.json of a Hugging Face model directory that has one "
                          "(e.g. an instruct model's), or write the records as prompt / completion pairs")
