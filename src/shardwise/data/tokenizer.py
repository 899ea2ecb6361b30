"""The run's tokenizer: byte-level (256 bytes + <|endoftext|>), a BPE trained on the corpus's first
documents (cached under data.cache_dir, keyed by the corpus's fingerprint and the vocabulary size), or a
user's tokenizer.json. Hugging Face `tokenizers` does the work; this module chooses and checks.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shardwise.data.publish import publish_bytes
from shardwise.errors import ConfigError

EOD_TOKEN = "<|endoftext|>"
# End-of-document tokens recognised in a user's tokenizer.json, in order of preference.
EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>")
# BPE is trained on the first ~8 MB of text: enough for a few-thousand-token vocabulary to settle, and
# it keeps training under ~20 s on 2 cores. The whole corpus is still tokenized.
BPE_TRAIN_CHARS = 8_000_000


def short_key(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def byte_tokenizer() -> Tokenizer:
    """256 byte tokens (id = byte value) + <|endoftext|> (id 256), as a merge-free byte-level BPE."""
    # GPT-2's printable stand-ins for the 256 bytes, which is what the ByteLevel pre-tokenizer emits.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    vocab = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOD_TOKEN])
    return tok


def _train_bpe(documents: Iterable[str], vocab_size: int) -> Tokenizer:
    def sample() -> Iterator[str]:
        seen = 0
        for doc in documents:
            yield doc
            seen += len(doc)
            if seen >= BPE_TRAIN_CHARS:
                return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sample(), trainer=trainer)
    return tok


def tokenizer_vocab(tok: Tokenizer) -> int:
    """Rows a model needs for this tokenizer: largest id + 1 (robust to holes in the id space)."""
    return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def tokenizer_file(kind: str, cache_dir: Path, vocab_size: int, fingerprint: Callable[[], str],
                   documents: Callable[[], Iterable[str]], create: bool = True) -> tuple[Path, bool]:
    """Path of the tokenizer.json to use, creating it if needed (unless `create` is false); also whether it was
    already there. `fingerprint()` names the corpus a BPE is trained on and `documents()` yields its text (both
    called only for "bpe")."""
    if kind in ("byte", "bpe"):
        if vocab_size < 257:
            raise ConfigError("model.vocab_size", f"{vocab_size} is too small for the {kind} tokenizer "
                              "(256 bytes + <|endoftext|> need 257)", "set model.vocab_size >= 257")
        text = byte_tokenizer().to_str() if kind == "byte" else None
        key = short_key("byte", text) if kind == "byte" else short_key(fingerprint(), vocab_size, "bpe")
        path = cache_dir / "tokenizers" / f"{key}.json"
        existed = path.is_file()
        if not existed and create:
            publish_bytes(path, (text or _train_bpe(documents(), vocab_size).to_str()).encode())
        return path, existed
    path = Path(os.path.expanduser(kind))
    if not path.is_file():
        raise ConfigError("data.tokenizer", f"{kind!r} is neither 'bpe', 'byte' nor an existing file",
                          'use "bpe", "byte" or the path of a tokenizer.json')
    return path, True


def load_tokenizer(path: Path, vocab_size: int) -> Tokenizer:
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception on malformed files
        raise ConfigError("data.tokenizer", f"cannot load {path}: {e}", "give a valid tokenizer.json") from None
    n = tokenizer_vocab(tok)
    if n > vocab_size:
        raise ConfigError("model.vocab_size", f"the tokenizer {path} has {n} tokens but the model only "
                          f"{vocab_size} embedding rows", f"set model.vocab_size >= {n}")
    return tok


def eod_id(tok: Tokenizer, path: Path | str = "") -> int:
    """Id of the end-of-document token appended after every document."""
    for name in EOD_CANDIDATES:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise ConfigError("data.tokenizer", f"the tokenizer {path} has no end-of-document token "
                      f"(looked for {', '.join(EOD_CANDIDATES)})", f"add {EOD_TOKEN} as a special token")
