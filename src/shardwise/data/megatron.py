"""A Megatron-LM indexed dataset (PREFIX.bin + PREFIX.idx, from its tools/preprocess_data.py) read as it
is: no preparation, the tokens memory-mapped in place. Its documents are its index's documents, and the
tokens are taken as they are (Megatron appends an end-of-document token only with --append-eod).

What a run must know of it and cannot see in the index — the digest the ranks of a job compare and
the largest token id, checked against the tokenizer before any process starts — is read in one pass
over the .bin the first time, and kept under data.cache_dir keyed by the files' paths, sizes and times.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from shardwise.data.prepared import PreparedCorpus
from shardwise.data.publish import publish_bytes
from shardwise.data.shards import TokenStream, index_arrays, read_index_header
from shardwise.data.tokenizer import short_key
from shardwise.errors import ConfigError

# Tokens read per step of the one pass (64 MiB of int32).
_PASS_TOKENS = 1 << 24


def megatron_prefix(path: str) -> str | None:
    """PREFIX when `path` names a Megatron dataset (PREFIX, PREFIX.bin or PREFIX.idx with both files there)."""
    if not path:
        return None
    p = os.path.expanduser(path)
    prefix = p[:-4] if p.endswith((".bin", ".idx")) else p
    return prefix if os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx") else None


def _facts(bin_path: Path, dtype: np.dtype, tokens: int, cache_dir: Path, log: Callable[[str], None]) -> dict:
    idx_path = bin_path.with_suffix(".idx")
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in (bin_path, idx_path)]
    cached = cache_dir / "megatron" / f"{short_key(*stats)}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    log(f"data: reading {bin_path} once ({tokens / 1e6:,.1f}M tokens) for its digest and largest token id")
    digest = hashlib.sha256()
    with open(idx_path, "rb") as f:
        digest.update(f.read())
    largest = -1
    tokens_map = np.memmap(bin_path, dtype=dtype, mode="r", shape=(tokens,)) if tokens else np.zeros(0, dtype)
    for start in range(0, tokens, _PASS_TOKENS):
        chunk = np.ascontiguousarray(tokens_map[start:start + _PASS_TOKENS])
        digest.update(chunk.data)
        largest = max(largest, int(chunk.max()))
        if int(chunk.min()) < 0:
            raise ConfigError("data.path", f"{bin_path} holds negative token ids", "give a dataset of token ids")
    facts = {"sha256": digest.hexdigest(), "max_id": largest}
    publish_bytes(cached, json.dumps(facts).encode())
    return facts


def open_megatron(prefix: str, field: str, name: str, cache_dir: Path, vocab: int, tokenizer: str,
                  log: Callable[[str], None]) -> PreparedCorpus:
    """The dataset at PREFIX, checked: its index, its size, and its token ids against the tokenizer's
    vocabulary (`vocab`)."""
    bin_path, idx_path = Path(prefix + ".bin"), Path(prefix + ".idx")
    header = read_index_header(idx_path, field)
    lengths, pointers, docs = index_arrays(idx_path)
    tokens = int(lengths.astype(np.int64).sum())
    size = bin_path.stat().st_size
    if size != tokens * header.dtype.itemsize:
        raise ConfigError(field, f"{bin_path} holds {size:,} bytes but its index {idx_path} describes {tokens:,} "
                          f"{header.dtype.name} tokens ({tokens * header.dtype.itemsize:,} bytes)",
                          "give the .bin and .idx written together by one preprocessing run")
    if len(pointers) and pointers[-1] + int(lengths[-1]) * header.dtype.itemsize != size:
        raise ConfigError(field, f"{idx_path}: its sequences are not one after another in {bin_path}",
                          "give an index written by Megatron-LM's IndexedDatasetBuilder")
    facts = _facts(bin_path, header.dtype, tokens, cache_dir, log)
    if facts["max_id"] >= vocab:
        raise ConfigError("data.tokenizer", f"{prefix} holds token ids up to {facts['max_id']:,}, but the tokenizer "
                          f"{tokenizer} has {vocab:,}: it was not made with this tokenizer",
                          "set data.tokenizer to the tokenizer.json the dataset was preprocessed with")
    manifest = {"name": name, "megatron": prefix, "tokens": tokens, "documents": max(len(docs) - 1, 0),
                "sha256": facts["sha256"], "dtype": header.dtype.name}
    return PreparedCorpus(bin_path.parent, manifest, TokenStream([str(bin_path)], [tokens], header.dtype), None)
