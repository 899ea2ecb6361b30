"""A prepared corpus on disk, and how it is found again.

    <data.cache_dir>/prepared/<corpus>-<inputs>/
        manifest.json      written last, atomically: the preparation is complete when it exists
        tokenizer.json     the tokenizer the shards were made with (a copy: the directory stands alone)
        shards/NNNNN.bin   tokens (data/shards.py: Megatron's indexed-dataset format)
        shards/NNNNN.idx   document lengths and offsets
        shards/NNNNN.json  the shard's facts, written after its .bin and .idx: the shard is done
        valid/NNNNN.bin    with data.valid_fraction: the unit's held-out documents (data/holdout.py),
        valid/NNNNN.idx    written before shards/NNNNN.json
        .lock              held while a process prepares it (others wait)

<corpus> names what is prepared — the source's path, text key, tokenizer kind, vocabulary size, shard
size and bad-record policy — and <inputs> what it was prepared from: its files' fingerprints (relative
path, size, mtime) and the tokenizer's digest. A run finds a complete directory of the same <corpus>
and <inputs> and reads its manifest (a few stat calls and one small file). When the files changed
since a preparation of the same <corpus>, `train` names them instead of preparing again behind the
user's back; `shardwise data prepare` prepares the new files into a new directory and keeps the old.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardwise.data.corpus import changed_files
from shardwise.data.shards import TokenStream
from shardwise.data.tokenizer import short_key
from shardwise.errors import ConfigError

FORMAT = "shardwise-prepared-v1"
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
SHARDS = "shards"
VALID = "valid"  # the held-out documents' shards (data.valid_fraction), named as their training shards
# How often a process waiting for another's preparation says where it stands.
WAIT_REPORT_S = 30.0


def corpus_key(path_spec: str, text_key: str, tokenizer_kind: str, vocab_size: int, shard_bytes: int, policy: str,
               valid_fraction: float = 0.0, fmt: str = "text") -> str:
    held_out = (valid_fraction,) if valid_fraction > 0 else ()  # without one, the keys of before
    records = (fmt,) if fmt != "text" else ()  # fine-tuning records: another corpus from the same files
    return short_key(FORMAT, path_spec, text_key, tokenizer_kind, vocab_size, shard_bytes, policy, *held_out, *records)


def prepared_dir(cache_dir: Path, corpus: str, fingerprints: list[dict], tokenizer_sha256: str) -> Path:
    inputs = short_key(json.dumps(fingerprints, sort_keys=True), tokenizer_sha256)
    return cache_dir / "prepared" / f"{corpus}-{inputs}"


def read_manifest(directory: Path) -> dict | None:
    """The manifest of a complete preparation, else None."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if manifest.get("format") == FORMAT else None


def preparations(cache_dir: Path, corpus: str) -> list[tuple[Path, dict]]:
    """Every complete preparation of this corpus (from whichever inputs), newest first."""
    found = []
    for directory in sorted((cache_dir / "prepared").glob(f"{corpus}-*")):
        if directory.is_dir() and (manifest := read_manifest(directory)) is not None:
            found.append((directory.stat().st_mtime, directory, manifest))
    return [(d, m) for _, d, m in sorted(found, key=lambda x: x[0], reverse=True)]


def refuse_changed_inputs(field: str, shown: str, earlier: Path, manifest: dict, fingerprints: list[dict],
                          advice: str) -> None:
    """ConfigError naming the files that changed since `earlier` was prepared from them."""
    changes = changed_files(manifest["source"]["files"], fingerprints)
    if not changes:
        return  # the same files: another tokenizer, prepared anew without asking
    listed = ", ".join(changes[:5]) + (f" and {len(changes) - 5} more" if len(changes) > 5 else "")
    raise ConfigError(field, f"{shown} changed since it was prepared into {earlier}: {listed}",
                      f"prepare it again: {advice} (a new preparation; the earlier one is kept, and a "
                      "run resumed from a checkpoint of the earlier data is refused), or restore the files")


@dataclass
class PreparedCorpus:
    """A complete preparation (or a Megatron dataset read as it is), ready to be read."""

    directory: Path
    manifest: dict
    stream: TokenStream
    tokenizer_path: Path | None  # None for a Megatron dataset (its tokenizer is data.tokenizer)
    valid: TokenStream | None = None  # the held-out documents (data.valid_fraction)

    @property
    def tokens(self) -> int:
        return len(self.stream)

    @property
    def documents(self) -> int:
        return int(self.manifest["documents"])

    @property
    def sha256(self) -> str:
        return self.manifest["sha256"]

    @property
    def finetune(self) -> bool:
        """Fine-tuning records (data/finetune.py), read as packed rows (data/packing.py)."""
        return "finetune" in self.manifest


def open_prepared(directory: Path, manifest: dict) -> PreparedCorpus:
    shards = manifest["shards"]
    bins = [str(directory / SHARDS / f"{s['name']}.bin") for s in shards]
    stream = TokenStream(bins, [s["tokens"] for s in shards], np.dtype(manifest["dtype"]))
    valid = None
    if "valid" in manifest:
        parts = manifest["valid"]["shards"]
        valid = TokenStream([str(directory / VALID / f"{s['name']}.bin") for s in parts], [s["tokens"] for s in parts],
                            np.dtype(manifest["dtype"]))
    return PreparedCorpus(directory, manifest, stream, directory / TOKENIZER, valid)


class PrepareLock:
    """An exclusive flock on <directory>/.lock that waits: one process prepares, the others (ranks, nodes
    sharing the cache over a network file system, a second `train`) wait for it and then read its result.
    The kernel releases the lock of a killed process; the next one resumes its preparation."""

    def __init__(self, directory: Path):
        self.path = directory / ".lock"
        self.fd: int | None = None

    def acquire(self, log: Callable[[str], None], status: Callable[[], str]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        said = 0.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now - said >= WAIT_REPORT_S:
                    try:
                        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
                    except (OSError, ValueError):
                        holder = {}
                    who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
                    log(f"data: waiting for {who}, which is preparing {self.path.parent} ({status()})")
                    said = now
                time.sleep(0.2)
            except OSError as e:  # a file system without locks (ENOLCK): one preparer at a time is then the user's
                log(f"data: cannot lock {self.path} ({e.strerror}): preparing without the lock; start one preparation "
                    "of this corpus at a time")
                os.close(fd)
                return
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self.fd = fd

    def try_acquire(self) -> bool:
        """Take the lock if nobody holds it (never waits)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held, or a file system without locks: then nothing may assume it is free
            os.close(fd)
            return False
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None
