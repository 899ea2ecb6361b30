"""Token shards on disk, in Megatron-LM's indexed-dataset format: NAME.bin holds the tokens of every
document one after another (uint16 when the vocabulary fits, else int32: Megatron's codes have no
uint32), NAME.idx their lengths and offsets. So a shard written here is one Megatron reads, and a
dataset Megatron's tools prepared is read here as it is (data.path = PREFIX).

The .idx layout (megatron/core/datasets/indexed_dataset.py, version 1): the 9-byte magic, the version
(<Q), the token dtype's code (<B), the sequence count and the document count (<Q each), then int32
sequence lengths, int64 byte offsets of the sequences in .bin, and int64 document indices (sequence
numbers where documents start, from 0 to the sequence count). Here a sequence is a document.

TokenStream reads a list of .bin files as one stream of tokens (a prepared corpus's shards, in order),
memory-mapped on first use with at most MAX_OPEN maps at once (each map holds a file descriptor).
"""
from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardwise.data.publish import TMP_SUFFIX, sync_directory
from shardwise.errors import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Megatron's DType codes (indexed_dataset.py DType).
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
CODES = {np.dtype(v).name: k for k, v in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")
# Token shards mapped at once by one reader: far below the usual 1,024 descriptors per process.
MAX_OPEN = 64


def token_dtype(vocab: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab <= 1 << 16 else np.int32)


class ShardWriter:
    """One shard written as it is tokenized: tokens appended to a temporary .bin (hashed on the way), the
    .idx written at the end, both published by rename (`finish`); `abort` leaves nothing behind."""

    def __init__(self, directory: Path, name: str, dtype: np.dtype):
        self.directory, self.name, self.dtype = directory, name, np.dtype(dtype)
        self.bin_path, self.idx_path = directory / f"{name}.bin", directory / f"{name}.idx"
        self._tmp_bin = directory / f".{name}.bin.{os.getpid()}{TMP_SUFFIX}"
        self._tmp_idx = directory / f".{name}.idx.{os.getpid()}{TMP_SUFFIX}"
        self._file = open(self._tmp_bin, "wb")
        self.lengths: list[int] = []
        self._open = 0  # tokens of the document being written
        self.tokens = 0
        self.digest = hashlib.sha256()

    def add(self, ids: np.ndarray, items: list[tuple[int, bool]]) -> None:
        """Append `ids`: the tokens of consecutive items, each (its token count, whether it ends its
        document); an item that does not is continued by the next one (a big text file's chunks)."""
        data = np.ascontiguousarray(ids, dtype=self.dtype).tobytes()
        self._file.write(data)
        self.digest.update(data)
        self.tokens += len(ids)
        for n, ends in items:
            self._open += n
            if ends:
                self.lengths.append(self._open)
                self._open = 0

    def finish(self) -> dict:
        """Publish the shard; returns its facts (tokens, documents, sha256, open_end)."""
        open_end = self._open > 0  # a big text file's document goes on in the next shard
        if open_end:
            self.lengths.append(self._open)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        write_index(self._tmp_idx, self.lengths, self.dtype)
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, self.idx_path)
        sync_directory(self.directory)
        return {"tokens": self.tokens, "documents": len(self.lengths) - int(open_end), "sha256": self.digest.hexdigest(),
                "open_end": open_end}

    def abort(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass
        for tmp in (self._tmp_bin, self._tmp_idx):
            tmp.unlink(missing_ok=True)


def write_index(path: Path, lengths: list[int], dtype: np.dtype) -> None:
    dtype = np.dtype(dtype)
    lens = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lens), dtype=np.int64)
    if len(lens):
        np.cumsum(lens[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, CODES[dtype.name], len(lens), len(lens) + 1))
        f.write(lens.tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(len(lens) + 1, dtype=np.int64).tobytes())
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class IndexHeader:
    dtype: np.dtype
    sequences: int
    documents: int  # Megatron's count: document starts, one more than the documents
    offset: int  # of the sequence lengths


def read_index_header(path: Path, field: str = "data.path") -> IndexHeader:
    """The .idx header, checked: ConfigError naming the file when it is not a Megatron index."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size)
    except OSError as e:
        raise ConfigError(field, f"cannot read {path}: {e.strerror}", "give a readable Megatron-LM .idx file") from None
    if len(raw) < _HEADER.size or raw[:9] != MAGIC:
        raise ConfigError(field, f"{path} is not a Megatron-LM indexed dataset index (no MMIDIDX header)",
                          "give the PREFIX of a .bin / .idx pair written by Megatron-LM's preprocess_data.py")
    _, version, code, sequences, documents = _HEADER.unpack(raw)
    if version != VERSION or code not in DTYPE_CODES or np.dtype(DTYPE_CODES[code]).kind not in "iu":
        raise ConfigError(field, f"{path}: index version {version} with dtype code {code} is not one this reader "
                          "knows (version 1, integer tokens)", "prepare the corpus with `shardwise data prepare` instead")
    return IndexHeader(np.dtype(DTYPE_CODES[code]), sequences, documents, _HEADER.size)


def index_arrays(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sequence lengths, sequence byte offsets, document indices) of an .idx, memory-mapped."""
    h = read_index_header(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(raw, dtype=np.int32, count=h.sequences, offset=h.offset)
    pointers = np.frombuffer(raw, dtype=np.int64, count=h.sequences, offset=h.offset + 4 * h.sequences)
    docs = np.frombuffer(raw, dtype=np.int64, count=h.documents, offset=h.offset + 12 * h.sequences)
    return lengths, pointers, docs


class TokenStream:
    """Several .bin files read as one stream of tokens, each mapped when first read."""

    def __init__(self, bins: list[str], counts: list[int], dtype: np.dtype):
        self.bins, self.counts, self.dtype = list(bins), [int(c) for c in counts], np.dtype(dtype)
        self.starts = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(np.asarray(self.counts, dtype=np.int64), out=self.starts[1:])
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getstate__(self) -> dict:
        """What a data-loader worker receives: the paths and counts, never the mapped tokens."""
        return {**self.__dict__, "_maps": OrderedDict()}

    def _map(self, i: int) -> np.ndarray:
        arr = self._maps.get(i)
        if arr is None:
            if len(self._maps) >= MAX_OPEN:
                self._maps.popitem(last=False)
            arr = np.memmap(self.bins[i], dtype=self.dtype, mode="r", shape=(self.counts[i],)) if self.counts[i] \
                else np.zeros(0, dtype=self.dtype)
            self._maps[i] = arr
        else:
            self._maps.move_to_end(i)
        return arr

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream, across shard boundaries."""
        parts = []
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            base = int(self.starts[shard])
            end = min(stop, int(self.starts[shard + 1]))
            parts.append(self._map(shard)[start - base:end - base])
            start = end
            shard += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """(len(starts), length) int64 rows: the tokens from each start."""
        starts = np.asarray(starts, dtype=np.int64)
        out = np.empty((len(starts), length), dtype=np.int64)
        offsets = np.arange(length)[None, :]
        first = np.searchsorted(self.starts, starts, side="right") - 1
        last = np.searchsorted(self.starts, starts + length - 1, side="right") - 1
        for shard in np.unique(first[first == last]):  # rows inside one file: fancy indexing reads just them
            rows = np.flatnonzero((first == shard) & (last == shard))
            out[rows] = self._map(int(shard))[starts[rows, None] - self.starts[shard] + offsets]
        for row in np.flatnonzero(first != last):  # a row across a shard boundary
            out[row] = self.read(int(starts[row]), int(starts[row]) + length)
        return out
