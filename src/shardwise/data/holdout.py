"""Which documents are held out for validation (data.valid_fraction): decided by a hash of the document.

A document's side depends on nothing but its own content — not on the file it sits in, the order of the
files, data.shard_mb, the number of preparation workers or the layout that trains on it — so the split
is the same on every run, and two copies of a document (web corpora hold many) land on the same side:
no validation document is trained on verbatim. Megatron-LM's --split cuts by position in the document
index instead, which moves every boundary when a file is added.

A JSON / Parquet record is hashed as its text (UTF-8). A text file is one document that a big file's
units cut into several pieces, each tokenized in its own worker, so its key is the file's first
FILE_KEY_BYTES and its size, which every piece can read without the others.
"""
from __future__ import annotations

import hashlib
import os

FILE_KEY_BYTES = 1 << 16
_SPAN = 1 << 64


def text_key(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", errors="surrogatepass"), digest_size=8).digest()


def file_key(path: str) -> bytes:
    with open(path, "rb") as f:
        head = f.read(FILE_KEY_BYTES)
        size = os.fstat(f.fileno()).st_size
    return hashlib.blake2b(head + size.to_bytes(8, "little"), digest_size=8).digest()


def held_out(key: bytes, fraction: float) -> bool:
    """Whether a document with this key is held out: its 64-bit hash, as a fraction of 2^64, below `fraction`."""
    return fraction > 0 and int.from_bytes(key, "little") < fraction * _SPAN
