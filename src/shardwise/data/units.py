"""A corpus cut into units of about data.shard_mb input bytes: the work one preparation worker does at a
time, and the shard it writes. The cut depends on the files and shard_mb only — never on the number of
workers — so a corpus prepared with any --workers, interrupted or not, gives the same shards.

Small files are packed together, in order; a big text or JSON-lines file is cut at newlines (a text file
stays one document across its pieces: only its last piece ends it); a Parquet file is cut between row
groups; a JSON array is one piece (it can only be parsed from its start).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardwise.data.corpus import file_kind
from shardwise.data.records import Piece

# How far past a cut point a newline is looked for in a text file before the cut is made at a character
# boundary instead (a text without line breaks).
_NEWLINE_SEARCH = 1 << 20


@dataclass(frozen=True)
class Unit:
    index: int
    pieces: tuple[Piece, ...]
    bytes: int  # input bytes (Parquet: compressed bytes of its row groups)


def _next_cut(f, at: int, size: int, kind: str) -> int:
    """The first line start at or after byte `at` (JSON lines: always; text: else a UTF-8 character start)."""
    f.seek(at - 1)
    done = at - 1
    while done < size:
        block = f.read(1 << 16)
        if not block:
            break
        i = block.find(b"\n")
        if i >= 0:
            return done + i + 1
        done += len(block)
        if kind == "text" and done - at > _NEWLINE_SEARCH:
            break
    if kind == "jsonl":
        return size
    f.seek(at)
    head = f.read(4)
    skip = next((i for i, b in enumerate(head) if b & 0xC0 != 0x80), len(head))  # past continuation bytes
    return min(at + skip, size)


def _byte_pieces(path: Path, kind: str, size: int, target: int) -> list[tuple[Piece, int]]:
    if size <= target:
        return [(Piece(str(path), kind, 0, size), size)]
    cuts = [0]
    with open(path, "rb") as f:
        while cuts[-1] + target < size:
            cut = _next_cut(f, cuts[-1] + target, size, kind)
            if cut >= size:
                break
            cuts.append(cut)
    cuts.append(size)
    return [(Piece(str(path), kind, a, b, ends_document=(kind != "text" or b == size)), b - a) for a, b in zip(cuts, cuts[1:])]


def _parquet_pieces(path: Path, target: int) -> list[tuple[Piece, int]]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    out: list[tuple[Piece, int]] = []
    start, size = 0, 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        group = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
        if size and size + group > target:
            out.append((Piece(str(path), "parquet", start, g), size))
            start, size = g, 0
        size += group
    if meta.num_row_groups > start:
        out.append((Piece(str(path), "parquet", start, meta.num_row_groups), size))
    return out


def file_pieces(path: Path, target: int) -> list[tuple[Piece, int]]:
    """One file's pieces with their input bytes."""
    kind = file_kind(path)
    if kind == "parquet":
        return _parquet_pieces(path, target)
    size = path.stat().st_size
    if kind == "json":
        return [(Piece(str(path), kind, 0, size), size)]
    return _byte_pieces(path, kind, size, target)


def plan_units(files: list[Path], target: int) -> list[Unit]:
    """Every file's pieces, packed in order into units of at most `target` bytes (a piece bigger than
    that alone)."""
    units: list[Unit] = []
    pieces: list[Piece] = []
    size = 0
    for path in files:
        for piece, n in file_pieces(path, target):
            if pieces and size + n > target:
                units.append(Unit(len(units), tuple(pieces), size))
                pieces, size = [], 0
            pieces.append(piece)
            size += n
    if pieces:
        units.append(Unit(len(units), tuple(pieces), size))
    return units
