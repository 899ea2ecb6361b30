"""A corpus's files: which (data.path or a source's path: a file, a directory, a glob; by default the
Python standard library's own source), of what kind (plain text, JSON lines, a JSON array, Parquet; told
apart by content, and binaries refused before any process starts), and their fingerprint, which reads
nothing (relative paths, sizes, modification times): a prepared corpus records it, and one whose files
changed since is named file by file (data/prepared.py). How each kind is read: data/records.py.
"""
from __future__ import annotations

import glob
import os
import sysconfig
from collections.abc import Callable
from pathlib import Path

from shardwise.errors import ConfigError

DATA_SUFFIXES = frozenset({".txt", ".md", ".py", ".jsonl", ".ndjson", ".json", ".parquet"})
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
_PARQUET_MAGIC = b"PAR1"
_SNIFF_BYTES = 1 << 16


def stdlib_root() -> Path:
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


def corpus_root(path: str) -> Path:
    """What the files' relative paths are relative to: the stdlib for "", else the path as given."""
    return stdlib_root() if not path else Path(os.path.expanduser(path))


def corpus_files(path: str, field: str = "data.path") -> list[Path]:
    """The corpus files in a fixed order: the stdlib's source for "", else `path` (file, dir, glob)."""
    if not path:
        return _walk(stdlib_root(),
                     keep=lambda n: n.endswith(".py") and not n.startswith("test_"),
                     skip_dir=lambda d: d in _STDLIB_SKIP_DIRS)
    p = Path(os.path.expanduser(path))
    if p.is_file():
        return [p]
    if p.is_dir():
        # Hidden entries (.git, .venv, ...) are tooling, not corpus.
        files = _walk(p, keep=lambda n: not n.startswith(".") and Path(n).suffix.lower() in DATA_SUFFIXES,
                      skip_dir=lambda d: d.startswith("."))
        if files:
            return files
        raise ConfigError(field, f"directory {p} holds no {', '.join(sorted(DATA_SUFFIXES))} files",
                          f"point {field} at a directory with text, JSONL or Parquet files")
    if glob.has_magic(str(p)):
        files = sorted(Path(m) for m in glob.glob(str(p), recursive=True) if Path(m).is_file())
        if files:
            return files
        raise ConfigError(field, f"the pattern {path!r} matches no files",
                          "check the pattern (use ** for subdirectories) or give a file or directory")
    raise ConfigError(field, f"{path!r} does not exist",
                      'give an existing file, directory or glob pattern' + (', or "" for the built-in stdlib corpus'
                                                                             if field == "data.path" else ""))


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



def relative_name(path: Path, root: Path) -> str:
    if path == root:  # data.path names the file itself
        return path.name
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.resolve().as_posix()


def file_fingerprints(path: str, files: list[Path]) -> list[dict]:
    """[{"path": relative path, "size": bytes, "mtime_ns": ...}, ...]: what a preparation records of its
    inputs, and compares with the files of a later run (stat calls only)."""
    root = corpus_root(path)
    out = []
    for f in files:
        st = f.stat()
        out.append({"path": relative_name(f, root), "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def changed_files(before: list[dict], now: list[dict]) -> list[str]:
    """["a.jsonl (size 100 -> 120 bytes)", "b.jsonl (new)", "c.jsonl (removed)", ...] between two
    file_fingerprints lists."""
    old = {f["path"]: f for f in before}
    new = {f["path"]: f for f in now}
    out = []
    for name in sorted(set(old) | set(new)):
        if name not in old:
            out.append(f"{name} (new)")
        elif name not in new:
            out.append(f"{name} (removed)")
        elif old[name]["size"] != new[name]["size"]:
            out.append(f"{name} (size {old[name]['size']:,} -> {new[name]['size']:,} bytes)")
        elif old[name]["mtime_ns"] != new[name]["mtime_ns"]:
            out.append(f"{name} (modified since)")
    return out
