"""A checkpoint's manifest: what a complete checkpoint holds, so that a damaged one is recognised.

    <dir>/step_00000012/manifest.json   written last, inside step_N.tmp, before the rename into place
        {"format", "step", "good", "run_id", "written", "config": {fingerprinted keys},
         "files": {relative path: {"size": bytes, "sha256": hex}}}

A checkpoint is complete when its manifest exists (a directory from before manifests, with only the
old `COMPLETE` marker, is complete but cannot be verified). It is intact when every listed file is
there with its size and SHA-256. `good` is false for a checkpoint written in the middle of a streak of
skipped (non-finite) steps; pruning never deletes the newest good one.

Torch-free: the launcher reads manifests before spawning anything, and `shardwise checkpoint verify`
checks a directory without loading it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.errors import ConfigError

MANIFEST = "manifest.json"
LEGACY_MARKER = "COMPLETE"
FORMAT = "shardwise-checkpoint-v1"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_CHUNK = 8 << 20


@dataclass(frozen=True)
class Problem:
    """Why a checkpoint cannot be trusted: which file, and what is wrong with it."""

    file: str
    reason: str

    def __str__(self) -> str:
        return f"{self.file}: {self.reason}"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def is_complete(path: Path) -> bool:
    return (path / MANIFEST).is_file() or (path / LEGACY_MARKER).is_file()


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first (step_N.tmp, .corrupt, ... are not)."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if _STEP_DIR.match(p.name) and p.is_dir() and is_complete(p)]
    return sorted(found, key=step_of)


def file_digest(path: Path) -> tuple[int, str]:
    """(size, SHA-256 hex) of a file, read in 8 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def listed_files(step_dir: Path) -> list[str]:
    """Every file under a checkpoint directory but the manifest, as sorted relative posix paths."""
    out = []
    for root, _dirs, files in os.walk(step_dir):
        for name in files:
            rel = (Path(root) / name).relative_to(step_dir).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def check_file(step_dir: Path, rel: str, expected: dict[str, Any]) -> str | None:
    """None when `rel` has the size and checksum the manifest lists, else the reason it does not."""
    path = step_dir / rel
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != expected.get("size"):
        return f"size {size} bytes, the manifest says {expected.get('size')}"
    try:
        if file_digest(path)[1] != expected.get("sha256"):
            return "checksum mismatch (the content changed after it was written)"
    except OSError as e:
        return f"unreadable ({e.strerror or e})"
    return None


def read_manifest(step_dir: Path) -> dict[str, Any]:
    """The manifest of a checkpoint; raises ValueError(Problem) when it is missing or malformed."""
    path = step_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(Problem(MANIFEST, "missing")) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(Problem(MANIFEST, f"unreadable ({e})")) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise ValueError(Problem(MANIFEST, f"not a {FORMAT} manifest"))
    return manifest


def verify_files(step_dir: Path, manifest: dict[str, Any], names: list[str] | None = None) -> list[Problem]:
    """Check `names` (default: every file the manifest lists) against the manifest."""
    files = manifest["files"]
    problems = []
    for rel in sorted(files) if names is None else names:
        reason = check_file(step_dir, rel, files[rel])
        if reason is not None:
            problems.append(Problem(rel, reason))
    return problems


def write_manifest(step_dir: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest durably (a temporary file, fsync, rename): it is the completion mark."""
    tmp = step_dir / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / MANIFEST)


def fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable (POSIX: the directory entry lives in the directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def set_aside(step_dir: Path, why: str = "corrupt") -> Path:
    """Rename a checkpoint to step_N.<why> (then .<why>.1, ...): never deleted, never loaded again.
    `why`: "corrupt" (damaged, or incomplete: no manifest) or "superseded" (another trajectory's: a
    step the resumed run will write again, or one a fresh start found in its place)."""
    target = step_dir.with_name(f"{step_dir.name}.{why}")
    n = 0
    while target.exists():
        n += 1
        target = step_dir.with_name(f"{step_dir.name}.{why}.{n}")
    os.replace(step_dir, target)
    return target


def incomplete_checkpoints(directory: Path) -> list[Path]:
    """step_N directories without a manifest (or legacy marker): a save renames a checkpoint into place
    only after its manifest is written, so one of these lost its manifest afterwards. Never loaded."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if _STEP_DIR.match(p.name) and p.is_dir() and not is_complete(p)),
                  key=step_of)


def is_good(step_dir: Path) -> bool:
    """A checkpoint written after a finite step (legacy ones count as good)."""
    try:
        return bool(read_manifest(step_dir).get("good", True))
    except ValueError:
        return (step_dir / LEGACY_MARKER).is_file()


def to_prune(checkpoints: list[Path], keep: int) -> list[Path]:
    """The checkpoints (oldest first) beyond the newest `keep`, except the newest good one, which is
    kept whatever came after it: a streak of skipped steps must never leave only bad checkpoints. While
    bad ones follow it (a streak is running), the good one before it is kept too: the newest good one
    may hold the very weights the streak's first non-finite step came from, which a resume would replay
    (the trainer sets those aside after a divergence: trainer.py _set_aside_diverged)."""
    kept = set(checkpoints[-keep:]) if keep > 0 else set()
    flags = {p: is_good(p) for p in checkpoints}
    good = [p for p in checkpoints if flags[p]]
    if good:
        kept.add(good[-1])
        if len(good) > 1 and not flags[checkpoints[-1]]:
            kept.add(good[-2])
    return [p for p in checkpoints if p not in kept]


def remove(step_dir: Path) -> None:
    """Delete a checkpoint: rename it out of the step_N namespace first, so a crash mid-delete never
    leaves a half-deleted directory that still looks complete."""
    doomed = step_dir.with_name(f"{step_dir.name}.deleting")
    try:
        os.replace(step_dir, doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def remove_leftovers(directory: Path) -> None:
    """Finish deletions a crash interrupted (step_N.deleting)."""
    if directory.is_dir():
        for p in directory.glob("step_*.deleting"):
            shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------- what a checkpoint was trained on

def fingerprint(cfg, num_tokens: int, tokenizer_sha256: str) -> dict[str, Any]:
    """The settings a checkpoint cannot be resumed without: the model's resolved shape, the data (its
    token count and tokenizer) and the batch stream (sequence length, global batch, seed). The parallel
    layout, precision and optimizer settings may change on resume (checkpoints reshard)."""
    out: dict[str, Any] = {}
    for key, value in cfg.to_dict()["model"].items():
        if key == "moe":
            out.update({f"model.moe.{k}": v for k, v in value.items()})
        elif key != "preset":
            out[f"model.{key}"] = value
    out.update({"data.tokens": num_tokens, "data.tokenizer_sha256": tokenizer_sha256,
                "train.seq_len": cfg.train.seq_len, "train.global_batch": cfg.train.global_batch,
                "train.seed": cfg.train.seed})
    return out


def fingerprint_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """['model.dim: 64 -> 128', ...] for every key whose value differs."""
    keys = sorted(set(saved) | set(current))
    return [f"{k}: {saved.get(k, '(unset)')} -> {current.get(k, '(unset)')}" for k in keys if saved.get(k) != current.get(k)]


def refuse_changes(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """ConfigError listing what changed since `path` was written, if anything did."""
    differences = fingerprint_differences(saved, current)
    if differences:
        raise ConfigError("checkpoint.resume", f"{path} was written for another model, data or batch "
                          f"({'; '.join(differences)})", "use another --run.dir (or checkpoint.dir), or pass "
                          "--checkpoint.resume=false to start over (its checkpoints are then replaced)")
