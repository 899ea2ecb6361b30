"""The corpus: which files (data.path: a file, a directory, a glob; by default the Python standard
library's own source), how each is read (plain text, JSON lines, a JSON array, Parquet; told apart by
content, and binaries refused before any process starts), and a fingerprint of them that reads nothing
(train/data.py keys its tokenizer and token caches by it).
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

from shardwise.config import DataConfig
from shardwise.errors import ConfigError

_DATA_SUFFIXES = frozenset({".txt", ".md", ".py", ".jsonl", ".ndjson", ".json", ".parquet"})
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
# Bump when the way documents become tokens changes, so old caches are not reused.
_FORMAT_VERSION = "shardwise-data-v2"  # v2: files read by content (JSON lines in .json)
_PARQUET_MAGIC = b"PAR1"
_SNIFF_BYTES = 1 << 16


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _walk(root: Path, keep: Callable[[str], bool], skip_dir: Callable[[str], bool]) -> list[Path]:
    """Files under root accepted by keep(name), pruning skipped directories, sorted by relative posix path."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not skip_dir(d)]
        for name in filenames:
            if keep(name):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    return [p for _, p in sorted(found)]


def corpus_files(cfg: DataConfig) -> list[Path]:
    """The corpus files in a fixed order: the stdlib's source by default, else data.path (file, dir, glob)."""
    if not cfg.path:
        return _walk(_stdlib_root(),
                     keep=lambda n: n.endswith(".py") and not n.startswith("test_"),
                     skip_dir=lambda d: d in _STDLIB_SKIP_DIRS)
    p = Path(os.path.expanduser(cfg.path))
    if p.is_file():
        return [p]
    if p.is_dir():
        # Hidden entries (.git, .venv, ...) are tooling, not corpus.
        files = _walk(p, keep=lambda n: not n.startswith(".") and Path(n).suffix.lower() in _DATA_SUFFIXES,
                      skip_dir=lambda d: d.startswith("."))
        if files:
            return files
        raise ConfigError("data.path", f"directory {p} holds no {', '.join(sorted(_DATA_SUFFIXES))} files",
                          "point data.path at a directory with text, JSONL or Parquet files")
    if glob.has_magic(str(p)):
        files = sorted(Path(m) for m in glob.glob(str(p), recursive=True) if Path(m).is_file())
        if files:
            return files
        raise ConfigError("data.path", f"the pattern {cfg.path!r} matches no files",
                          "check the pattern (use ** for subdirectories) or give a file or directory")
    raise ConfigError("data.path", f"{cfg.path!r} does not exist",
                      'give an existing file, directory or glob pattern, or "" for the built-in stdlib corpus')


def _jsonl_documents(path: Path, text_key: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError("data.path", f"{path}:{lineno} is not valid JSON ({e.msg})",
                                  "JSONL files need one JSON object per line") from None
            if not isinstance(record, dict) or text_key not in record:
                keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
                raise ConfigError("data.text_key", f"{path}:{lineno} has no key {text_key!r} (found: {keys})",
                                  "set data.text_key to the field that holds the text")
            text = record[text_key]
            if not isinstance(text, str):
                raise ConfigError("data.text_key", f"{path}:{lineno}: {text_key!r} is a "
                                  f"{type(text).__name__}, not a string", "point data.text_key at a text field")
            yield text


def _parquet_documents(path: Path, text_key: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if text_key not in names:
        raise ConfigError("data.text_key", f"{path} has no column {text_key!r} (found: {', '.join(names)})",
                          "set data.text_key to the column that holds the text")
    for batch in pf.iter_batches(columns=[text_key]):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield str(text)


def _json_array_documents(path: Path, text_key: str) -> Iterator[str]:
    try:
        records = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as e:
        raise ConfigError("data.path", f"{path} is not valid JSON ({e.msg} at line {e.lineno})",
                          "a .json corpus is a JSON array of records or JSON lines") from None
    for i, record in enumerate(records):
        if isinstance(record, str):
            yield record
        elif isinstance(record, dict) and isinstance(record.get(text_key), str):
            yield record[text_key]
        else:
            raise ConfigError("data.text_key", f"{path}: item {i} is neither a string nor an object with a text field "
                              f"{text_key!r}", "set data.text_key to the field that holds the text")


def file_kind(path: Path) -> str:
    """How to read a corpus file, by its content as well as its name: "parquet" (by its magic bytes),
    "jsonl" (.jsonl, or a .json whose first line is an object), "json" (a .json array) or "text".
    A file that is not text (NUL bytes, or mostly non-text, in its first 64 KiB) is refused."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    suffix = path.suffix.lower()
    if head.startswith(_PARQUET_MAGIC):
        return "parquet"
    if suffix == ".parquet":
        raise ConfigError("data.path", f"{path} is named .parquet but is not a Parquet file (no PAR1 magic)",
                          "convert it, or give it the extension of what it holds")
    # Binary, as git and grep judge it: NUL bytes; or mostly undecodable / control characters. A few
    # stray bytes in real text (a Latin-1 character) are read with replacement characters instead.
    if b"\0" in head:
        raise ConfigError("data.path", f"{path} is not text (it contains NUL bytes: a binary file?)",
                          "train on text, JSON lines or Parquet files; remove binaries from data.path")
    text = head.decode("utf-8", errors="replace")
    odd = sum(ch == "\ufffd" or (ord(ch) < 32 and ch not in "\t\n\r\f\v\x1b") for ch in text)
    if text and odd > 0.3 * len(text):
        raise ConfigError("data.path", f"{path} is not text ({odd} of its first {len(text)} characters are not "
                          "UTF-8 text)", "re-encode it as UTF-8, or remove it from data.path")
    if suffix in (".json", ".jsonl", ".ndjson"):
        first = head.lstrip()[:1]
        if suffix == ".json" and first == b"[":
            return "json"
        if suffix != ".json" or first == b"{":
            return "jsonl"
    return "text"


def iter_documents(files: list[Path], text_key: str) -> Iterator[str]:
    """Every non-empty document of the corpus, in file order (empty ones would only add separators)."""
    readers = {"jsonl": _jsonl_documents, "json": _json_array_documents, "parquet": _parquet_documents}
    for path in files:
        kind = file_kind(path)
        docs = readers[kind](path, text_key) if kind in readers else \
            iter([path.read_text(encoding="utf-8", errors="replace")])
        yield from (d for d in docs if d)


def corpus_fingerprint(cfg: DataConfig, files: list[Path]) -> str:
    """sha256 over relative path, size and mtime_ns of every file, plus text_key: cheap, reads nothing."""
    root = _stdlib_root() if not cfg.path else Path(os.path.expanduser(cfg.path))
    h = hashlib.sha256(f"{_FORMAT_VERSION}\0{cfg.text_key}\0".encode())
    for path in files:
        st = path.stat()
        try:
            rel = path.relative_to(root).as_posix()
        except ValueError:
            rel = path.resolve().as_posix()
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()
