"""Corpus (train/corpus.py) -> tokenizer -> one cached token array -> layout-independent global batches.

Everything expensive (tokenizer training, tokenization) is cached under `data.cache_dir`, keyed by a
cheap corpus fingerprint (paths, sizes, mtimes; no reading), so a warm start costs a few stat calls.
Cache files are written to a temporary file in the same directory and published atomically, so several
ranks racing on the same cache all end up reading one and the same file.

Batches depend only on (tokens, seq_len, global_batch, seed, step): the batch view of a layout merely
slices the global batch (docs/architecture.md §3, "Data order does not depend on the layout").
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from shardwise.config import DataConfig
from shardwise.errors import ConfigError
from shardwise.train.corpus import corpus_files, corpus_fingerprint, iter_documents

EOD_TOKEN = "<|endoftext|>"
# End-of-document tokens recognised in a user's tokenizer.json, in order of preference.
_EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>")
# BPE is trained on the first ~8 MB of text: enough for a few-thousand-token vocabulary to settle, and
# it keeps training under ~20 s on 2 cores. The whole corpus is still tokenized.
_BPE_TRAIN_CHARS = 8_000_000
# Documents per encode call: bounds the memory held by Encoding objects on large corpora.
_ENCODE_CHUNK_CHARS = 2_000_000
# Tokens read per step when a token array's digest and document count are first computed (64 MiB of uint16).
_HASH_CHUNK_TOKENS = 1 << 25


# ---------------------------------------------------------------- cache helpers


def _short_key(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


def _publish(write: Callable[[Any], None], final: Path) -> None:
    """Write via a temp file in final's directory, then publish it atomically.

    The first publisher wins (os.link refuses to overwrite), so racing processes all read the same
    file even if their contents could differ; os.replace is the fallback where hard links are missing.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, final)
        except FileExistsError:
            pass
        except OSError:
            os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cache_dir(cfg: DataConfig) -> Path:
    return Path(os.path.expanduser(cfg.cache_dir))


# ---------------------------------------------------------------- tokenizers


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


def _train_bpe(files: list[Path], cfg: DataConfig, vocab_size: int) -> Tokenizer:
    def sample() -> Iterator[str]:
        seen = 0
        for doc in iter_documents(files, cfg.text_key):
            yield doc
            seen += len(doc)
            if seen >= _BPE_TRAIN_CHARS:
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


def _tokenizer_file(cfg: DataConfig, vocab_size: int, files: list[Path] | None = None,
                    fingerprint: str | None = None) -> tuple[Path, bool]:
    """Path of the tokenizer.json to use, creating it if needed; also whether it was already there."""
    kind = cfg.tokenizer
    if kind in ("byte", "bpe"):
        if vocab_size < 257:
            raise ConfigError("model.vocab_size", f"{vocab_size} is too small for the {kind} tokenizer "
                              "(256 bytes + <|endoftext|> need 257)", "set model.vocab_size >= 257")
        if kind == "byte":
            text: str | None = byte_tokenizer().to_str()
            key = _short_key("byte", text)
        else:
            text = None
            files = corpus_files(cfg) if files is None else files
            key = _short_key(fingerprint or corpus_fingerprint(cfg, files), vocab_size, "bpe")
        path = _cache_dir(cfg) / "tokenizers" / f"{key}.json"
        existed = path.is_file()
        if not existed:
            data = (text or _train_bpe(files or [], cfg, vocab_size).to_str()).encode()
            _publish(lambda f: f.write(data), path)
        return path, existed
    path = Path(os.path.expanduser(kind))
    if not path.is_file():
        raise ConfigError("data.tokenizer", f"{kind!r} is neither 'bpe', 'byte' nor an existing file",
                          'use "bpe", "byte" or the path of a tokenizer.json')
    return path, True


def _load_tokenizer(path: Path, vocab_size: int) -> Tokenizer:
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception on malformed files
        raise ConfigError("data.tokenizer", f"cannot load {path}: {e}", "give a valid tokenizer.json") from None
    n = tokenizer_vocab(tok)
    if n > vocab_size:
        raise ConfigError("model.vocab_size", f"the tokenizer {path} has {n} tokens but the model only "
                          f"{vocab_size} embedding rows", f"set model.vocab_size >= {n}")
    return tok


def load_or_train_tokenizer(cfg: DataConfig, vocab_size: int) -> Tokenizer:
    """The run's tokenizer: byte-level, BPE trained on the corpus (cached), or a user's tokenizer.json."""
    path, _ = _tokenizer_file(cfg, vocab_size)
    return _load_tokenizer(path, vocab_size)


def eod_id(tok: Tokenizer, path: Path | str = "") -> int:
    """Id of the end-of-document token appended after every document."""
    for name in _EOD_CANDIDATES:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise ConfigError("data.tokenizer", f"the tokenizer {path} has no end-of-document token "
                      f"(looked for {', '.join(_EOD_CANDIDATES)})", f"add {EOD_TOKEN} as a special token")


# ---------------------------------------------------------------- token array


@dataclass
class PreparedData:
    """What training needs from the data side; tokenizer_path travels with checkpoints."""

    tokens: np.ndarray  # 1-D, documents each followed by eod_id; memory-mapped from the cache
    tokenizer_path: Path
    tokenizer_vocab: int
    eod_id: int
    num_documents: int
    fingerprint: str
    tokens_sha256: str  # of the token array's bytes: the same data under any path (_token_facts)


def _tokenize(files: list[Path], cfg: DataConfig, tok: Tokenizer, eod: int, dtype: type) -> np.ndarray:
    # Corpus text that happens to spell "<|endoftext|>" stays text, so eod_id marks document ends only.
    tok.encode_special_tokens = True
    chunks: list[np.ndarray] = []

    def flush(docs: list[str]) -> None:
        ids: list[int] = []
        for enc in tok.encode_batch_fast(docs, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eod)
        chunks.append(np.asarray(ids, dtype=dtype))

    docs: list[str] = []
    size = 0
    for doc in iter_documents(files, cfg.text_key):
        docs.append(doc)
        size += len(doc)
        if size >= _ENCODE_CHUNK_CHARS:
            flush(docs)
            docs, size = [], 0
    if docs:
        flush(docs)
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


def prepare_data(cfg: DataConfig, vocab_size: int, log: Callable[[str], None] = print) -> PreparedData:
    """Tokenizer + the whole corpus as one token array, both cached; a warm call reads the tokenizer and
    stat()s, and maps the array without reading it."""
    t0 = time.perf_counter()
    files = corpus_files(cfg)
    fingerprint = corpus_fingerprint(cfg, files)
    tok_path, tok_cached = _tokenizer_file(cfg, vocab_size, files, fingerprint)
    tok = _load_tokenizer(tok_path, vocab_size)
    n_vocab = tokenizer_vocab(tok)
    eod = eod_id(tok, tok_path)
    key = _short_key(fingerprint, _file_sha256(tok_path))
    npy = _cache_dir(cfg) / "tokens" / f"{key}.npy"
    tokens_cached = npy.is_file()
    if not tokens_cached:
        dtype = np.uint16 if n_vocab <= 1 << 16 else np.int32
        arr = _tokenize(files, cfg, tok, eod, dtype)
        _publish(lambda f: np.save(f, arr, allow_pickle=False), npy)
    tokens = np.load(npy, mmap_mode="r", allow_pickle=False)
    tokens_sha256, num_documents = _token_facts(npy, tokens, eod)
    trained = not tok_cached and cfg.tokenizer == "bpe"
    what = "cached" if tokens_cached else ("tokenizer trained, tokenized" if trained else "tokenized")
    source = "stdlib" if not cfg.path else cfg.path
    log(f"data: {source}, {len(files)} files, {num_documents} docs, {len(tokens) / 1e6:.1f}M tokens, "
        f"vocab {n_vocab} ({what}, {time.perf_counter() - t0:.1f}s)")
    return PreparedData(tokens, tok_path, n_vocab, eod, num_documents, fingerprint, tokens_sha256)


def _token_facts(npy: Path, tokens: np.ndarray, eod: int) -> tuple[str, int]:
    """The SHA-256 of the token array's bytes and its number of documents (end-of-document tokens), cached
    beside it (<key>.facts.json): computed in one pass when the array is first tokenized (or first loaded
    without them), read afterwards. Counting the documents on every start read the whole array on every
    rank (1.45 s per 200M tokens here); the digest is what the ranks of a job compare to know they train on
    the same data, whatever its path (train/agreement.py)."""
    path = npy.with_name(f"{npy.stem}.facts.json")
    if path.is_file():
        facts = json.loads(path.read_text())
        return facts["sha256"], facts["documents"]
    digest, documents = hashlib.sha256(), 0
    flat = tokens.reshape(-1)
    for start in range(0, len(flat), _HASH_CHUNK_TOKENS):
        chunk = np.ascontiguousarray(flat[start:start + _HASH_CHUNK_TOKENS])
        digest.update(chunk.data)
        documents += int(np.count_nonzero(chunk == eod))
    _publish(lambda f: f.write(json.dumps({"sha256": digest.hexdigest(), "documents": documents}).encode()), path)
    facts = json.loads(path.read_text())  # the first publisher's, as for the array itself
    return facts["sha256"], facts["documents"]


# ---------------------------------------------------------------- batches


def split_inputs_targets(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T+1) windows -> inputs (B, T) and next-token targets (B, T), contiguous so .view() works."""
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()


def split_micro_batches(rows: torch.Tensor, micro_batch: int) -> list[torch.Tensor]:
    """A rank's rows of a step, cut into micro-batches in order."""
    if micro_batch < 1 or len(rows) % micro_batch:
        raise ValueError(f"local batch {len(rows)} is not divisible by micro_batch {micro_batch}")
    return list(rows.split(micro_batch))


@dataclass(frozen=True)
class _MappedTokens:
    path: str  # a .npy token file, mapped read-only


def check_corpus(num_tokens: int, seq_len: int, global_batch: int) -> int:
    """The corpus's number of (seq_len+1)-token windows; ConfigError when it cannot fill one global batch
    (the launcher asks before it spawns anything or creates the run directory)."""
    windows = max(num_tokens - 1, 0) // seq_len
    if windows == 0:
        raise ConfigError("data.path", f"the corpus has {num_tokens} tokens, fewer than one sequence of "
                          f"train.seq_len + 1 = {seq_len + 1}", "use a bigger corpus or a smaller train.seq_len")
    if windows < global_batch:
        raise ConfigError("train.global_batch", f"{global_batch} sequences per step, but the corpus only has "
                          f"{windows} windows of {seq_len} tokens",
                          f"set train.global_batch <= {windows}, lower train.seq_len, or use a bigger corpus")
    return windows


class TokenBatches:
    """Global batches of (seq_len+1)-token windows in a seeded order that no parallel layout changes.

    The sample stream is the concatenation of per-epoch permutations of all windows; step s takes
    stream items [s*B, (s+1)*B). The loader's position is the step alone, which makes resuming exact.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int):
        if seq_len < 1 or global_batch < 1:
            raise ValueError(f"seq_len ({seq_len}) and global_batch ({global_batch}) must be >= 1")
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.num_windows = check_corpus(len(tokens), seq_len, global_batch)
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)
        self._perms: dict[int, np.ndarray] = {}  # a step spans at most two epochs; keep those

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = torch.randperm(self.num_windows, generator=g).numpy()
        return self._perms[epoch]

    def window_indices(self, start: int, stop: int) -> np.ndarray:
        """Window ids of sample-stream items [start, stop)."""
        items = np.arange(start, stop, dtype=np.int64)
        epochs, pos = np.divmod(items, self.num_windows)
        out = np.empty_like(items)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self._perm(int(e))[pos[mask]]
        return out

    def _rows(self, start: int, stop: int) -> torch.Tensor:
        starts = self.window_indices(start, stop) * self.seq_len
        # Fancy indexing reads just these windows from the memmap.
        windows = self.tokens[starts[:, None] + self._offsets[None, :]]
        return torch.from_numpy(windows.astype(np.int64))

    def __getstate__(self) -> dict[str, Any]:
        """Sent to data-loader workers (train/loader.py): a memory-mapped token file travels as its path and
        is mapped again there, rather than pickled as a copy of the whole corpus."""
        state = {**self.__dict__, "_perms": {}}  # the epoch permutations are cheap to draw again
        if isinstance(self.tokens, np.memmap) and self.tokens.filename:
            state["tokens"] = _MappedTokens(str(self.tokens.filename))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["tokens"], _MappedTokens):
            state["tokens"] = np.load(state["tokens"].path, mmap_mode="r", allow_pickle=False)
        self.__dict__.update(state)

    def local_rows(self, step: int, batch_rank: int, batch_size: int) -> torch.Tensor:
        """This batch rank's contiguous share of step's global batch, (global_batch / batch_size, seq_len + 1)."""
        if batch_size < 1 or self.global_batch % batch_size:
            raise ValueError(f"global_batch {self.global_batch} is not divisible by the batch size {batch_size}")
        if not 0 <= batch_rank < batch_size:
            raise ValueError(f"batch_rank {batch_rank} is outside [0, {batch_size})")
        local = self.global_batch // batch_size
        start = step * self.global_batch + batch_rank * local
        return self._rows(start, start + local)

    def global_batch_at(self, step: int) -> torch.Tensor:
        """All B windows of a step, shape (global_batch, seq_len + 1), int64."""
        return self._rows(step * self.global_batch, (step + 1) * self.global_batch)

    def local_micro_batches(self, step: int, batch_rank: int, batch_size: int, micro_batch: int) -> list[torch.Tensor]:
        """This batch rank's contiguous share of the global batch, cut into micro-batches in order."""
        return split_micro_batches(self.local_rows(step, batch_rank, batch_size), micro_batch)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "seq_len": self.seq_len, "global_batch": self.global_batch,
                "num_windows": self.num_windows}

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse to resume onto different data: the step alone would then point at other samples."""
        fields = {"seed": "train.seed", "seq_len": "train.seq_len", "global_batch": "train.global_batch",
                  "num_windows": "data.path"}
        mine = self.state_dict()
        for key, field in fields.items():
            if state.get(key) != mine[key]:
                what = "the corpus or tokenizer changed" if key == "num_windows" else f"{field} changed"
                raise ConfigError(field, f"the checkpoint was written with {key}={state[key]}, this run has "
                                  f"{mine[key]} ({what})", "restore the original setting, or start a fresh run "
                                  "(checkpoint.resume=false or another checkpoint.dir)")
