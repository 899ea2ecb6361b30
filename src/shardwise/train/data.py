"""Prepared corpora (data/: token shards, a Megatron dataset) -> layout-independent global batches.

Batches depend only on the sources' tokens, seq_len, global_batch, seed, the mixture's weights (and
where they changed) and the step: the batch view of a layout merely slices the global batch
(docs/architecture.md §3, "Data order does not depend on the layout"). A source's samples are its
(seq_len+1)-token windows, read in a seeded permutation per pass over it (epoch); a mixture draws each
sample of a step from one source (data/mixture.py) and shuffles the step's rows.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from shardwise.data.finetune import IGNORE_INDEX
from shardwise.data.mixture import Blend, check_epochs
from shardwise.data.packing import source_rows
from shardwise.data.shards import TokenStream
from shardwise.data.sources import PreparedData, prepare_data
from shardwise.data.tokenizer import EOD_TOKEN, byte_tokenizer, eod_id, tokenizer_vocab
from shardwise.errors import ConfigError

__all__ = ["EOD_TOKEN", "BatchSource", "PreparedData", "TokenBatches", "byte_tokenizer", "check_corpus", "eod_id",
           "prepare_data", "split_inputs_targets", "split_micro_batches", "tokenizer_vocab"]


def split_inputs_targets(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T+1) windows -> inputs (B, T) and next-token targets (B, T), contiguous so .view() works. A
    fine-tuning row's token without loss is stored as ~id (data/finetune.py): its id as an input, and
    IGNORE_INDEX as a target. Text rows have no negative ids, so theirs pass unchanged."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    return torch.where(inputs < 0, ~inputs, inputs), torch.where(targets < 0, IGNORE_INDEX, targets)


def loss_token_count(targets: torch.Tensor) -> torch.Tensor:
    """The targets that carry loss (a fine-tuning step's loss is their mean: train/trainer.py)."""
    return (targets != IGNORE_INDEX).sum()


def split_micro_batches(rows: torch.Tensor, micro_batch: int) -> list[torch.Tensor]:
    """A rank's rows of a step, cut into micro-batches in order."""
    if micro_batch < 1 or len(rows) % micro_batch:
        raise ValueError(f"local batch {len(rows)} is not divisible by micro_batch {micro_batch}")
    return list(rows.split(micro_batch))


def check_corpus(num_tokens: int, seq_len: int, global_batch: int, field: str = "data.path", what: str = "the corpus") -> int:
    """The number of (seq_len+1)-token windows; ConfigError when they cannot fill one global batch (the
    launcher asks before it spawns anything or creates the run directory)."""
    windows = max(num_tokens - 1, 0) // seq_len
    if windows == 0:
        raise ConfigError(field, f"{what} has {num_tokens} tokens, fewer than one sequence of "
                          f"train.seq_len + 1 = {seq_len + 1}", "use a bigger corpus or a smaller train.seq_len")
    if windows < global_batch:
        raise ConfigError("train.global_batch", f"{global_batch} sequences per step, but {what} only has "
                          f"{windows} windows of {seq_len} tokens",
                          f"set train.global_batch <= {windows}, lower train.seq_len, or use a bigger corpus")
    return windows


class _ArrayTokens:
    """An in-memory token array read like a TokenStream (tests, small tools)."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        return self.tokens[starts[:, None] + np.arange(length)[None, :]].astype(np.int64)

    def __getstate__(self) -> dict[str, Any]:
        """A memory-mapped array travels as its file (mapped again by the receiver), never as a copy."""
        t = self.tokens
        if isinstance(t, np.memmap) and t.filename:
            return {"map": (t.filename, t.dtype.str, t.offset, t.shape)}
        return {"tokens": t}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "map" in state:
            filename, dtype, offset, shape = state["map"]
            self.tokens = np.memmap(filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=shape)
        else:
            self.tokens = state["tokens"]


@dataclass(frozen=True)
class BatchSource:
    name: str
    tokens: Any  # TokenStream (or _ArrayTokens)
    weight: float = 1.0
    max_epochs: float = 0.0
    field: str = "data.path"


def batch_sources(data: PreparedData, seq_len: int, loss_on: str = "completion") -> list[BatchSource]:
    """Each source's rows: a text corpus's stream (windows), fine-tuning records packed (data/packing.py)."""
    return [BatchSource(s.spec.name, source_rows(s.corpus.stream, s.corpus.finetune, seq_len, loss_on, data.eod_id),
                        s.spec.weight, s.spec.max_epochs, s.spec.field) for s in data.sources]


class TokenBatches:
    """Global batches of (seq_len+1)-token windows in a seeded order that no parallel layout changes.

    One source: the sample stream is the concatenation of per-epoch permutations of all its windows;
    step s takes stream items [s*B, (s+1)*B). A mixture: sample n of the stream comes from the source and
    index data/mixture.py Blend assigns it, each source read in its own per-epoch permutations. The
    loader's position is the step alone, which makes resuming exact."""

    def __init__(self, sources: Sequence[BatchSource] | np.ndarray | TokenStream, seq_len: int, global_batch: int, seed: int):
        if seq_len < 1 or global_batch < 1:
            raise ValueError(f"seq_len ({seq_len}) and global_batch ({global_batch}) must be >= 1")
        if not isinstance(sources, (list, tuple)):
            tokens = sources if isinstance(sources, TokenStream) else _ArrayTokens(sources)
            sources = [BatchSource("corpus", tokens)]
        self.sources = [s if hasattr(s.tokens, "windows") else replace(s, tokens=_ArrayTokens(s.tokens)) for s in sources]
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.mixture = len(self.sources) > 1
        if self.mixture:
            self.windows = [check_corpus(len(s.tokens), seq_len, 1, s.field, f"source {s.name!r}") for s in self.sources]
        else:
            self.windows = [check_corpus(len(self.sources[0].tokens), seq_len, global_batch)]
        self.num_windows = sum(self.windows)
        self.blend = Blend.start([s.name for s in self.sources], [s.weight for s in self.sources])
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)
        self._perms: dict[tuple[int, int], np.ndarray] = {}  # a step spans at most two epochs of a source

    # ---- the order
    def _perm(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._perms:
            if self.mixture:  # a source's order does not depend on the others, nor on its place in the list
                seed = int(hashlib.sha256(f"{self.seed}/{self.sources[source].name}/{epoch}".encode()).hexdigest()[:15], 16)
            else:
                seed = self.seed * 7919 + epoch
            mine = [k for k in self._perms if k[0] == source]
            if len(mine) >= 2:
                self._perms.pop(min(mine))
            n = self.windows[source]
            self._perms[key] = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
        return self._perms[key]

    def _source_windows(self, source: int, index: np.ndarray) -> np.ndarray:
        epochs, pos = np.divmod(index, self.windows[source])
        out = np.empty_like(index)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self._perm(source, int(e))[pos[mask]]
        return out

    def window_indices(self, start: int, stop: int) -> np.ndarray:
        """Window ids of (one source's) sample-stream items [start, stop)."""
        return self._source_windows(0, np.arange(start, stop, dtype=np.int64))

    def samples(self, step: int, rows: slice) -> tuple[np.ndarray, np.ndarray]:
        """(source, window id) of the given rows of step's global batch."""
        positions = np.arange(self.global_batch, dtype=np.int64)[rows]
        if not self.mixture:
            items = step * self.global_batch + positions
            return np.zeros(len(items), dtype=np.int64), self._source_windows(0, items)
        # The blend interleaves sources regularly; the rows of a step are shuffled so that no rank or
        # micro-batch always draws the same source.
        order = torch.randperm(self.global_batch, generator=torch.Generator().manual_seed(self.seed * 7919 + 104_729 + step))
        source, index = self.blend.assign(step * self.global_batch + order.numpy()[positions])
        windows = np.empty_like(index)
        for s in np.unique(source):
            mask = source == s
            windows[mask] = self._source_windows(int(s), index[mask])
        return source, windows

    def _rows(self, step: int, rows: slice) -> torch.Tensor:
        source, windows = self.samples(step, rows)
        out = np.empty((len(windows), self.seq_len + 1), dtype=np.int64)
        for s in np.unique(source):
            mask = source == s
            out[mask] = self.sources[int(s)].tokens.windows(windows[mask] * self.seq_len, self.seq_len + 1)
        return torch.from_numpy(out)

    def local_rows(self, step: int, batch_rank: int, batch_size: int) -> torch.Tensor:
        """This batch rank's contiguous share of step's global batch, (global_batch / batch_size, seq_len + 1)."""
        if batch_size < 1 or self.global_batch % batch_size:
            raise ValueError(f"global_batch {self.global_batch} is not divisible by the batch size {batch_size}")
        if not 0 <= batch_rank < batch_size:
            raise ValueError(f"batch_rank {batch_rank} is outside [0, {batch_size})")
        local = self.global_batch // batch_size
        return self._rows(step, slice(batch_rank * local, (batch_rank + 1) * local))

    def global_batch_at(self, step: int) -> torch.Tensor:
        """All B windows of a step, shape (global_batch, seq_len + 1), int64."""
        return self._rows(step, slice(None))

    def local_micro_batches(self, step: int, batch_rank: int, batch_size: int, micro_batch: int) -> list[torch.Tensor]:
        """This batch rank's contiguous share of the global batch, cut into micro-batches in order."""
        return split_micro_batches(self.local_rows(step, batch_rank, batch_size), micro_batch)

    def __getstate__(self) -> dict[str, Any]:
        """Sent to data-loader workers (train/loader.py): the sources travel as their files' paths (TokenStream
        maps them again there), the epoch permutations are drawn again."""
        return {**self.__dict__, "_perms": {}}

    # ---- what has been read, and resuming
    def consumed(self, step: int) -> dict[str, int]:
        """Samples each source has given in steps [0, step)."""
        counts = self.blend.consumed(step * self.global_batch)
        return {s.name: c for s, c in zip(self.sources, counts)}

    def check_epochs(self, steps: int) -> None:
        """ConfigError when train.steps would read a source over more than its max_epochs."""
        check_epochs([s.name for s in self.sources], [s.field.rsplit(".", 1)[0] + ".max_epochs" for s in self.sources],
                     self.windows, [s.max_epochs for s in self.sources], self.blend, steps * self.global_batch, steps)

    def state_dict(self) -> dict[str, Any]:
        state = {"seed": self.seed, "seq_len": self.seq_len, "global_batch": self.global_batch, "num_windows": self.num_windows}
        if self.mixture:
            state["sources"] = [{"name": s.name, "windows": w} for s, w in zip(self.sources, self.windows)]
            state["blend"] = self.blend.state()
        return state

    def load_state(self, state: dict[str, Any], step: int) -> str | None:
        """Resume at `step` from a checkpoint's data state: refuses other data (the step alone would then point
        at other samples); a mixture whose weights changed goes on from each source's count. Returns the line
        that names the change, or None."""
        fields = {"seed": "train.seed", "seq_len": "train.seq_len", "global_batch": "train.global_batch"}
        mine = self.state_dict()
        for key, field in fields.items():
            if state.get(key) != mine[key]:
                raise ConfigError(field, f"the checkpoint was written with {key}={state[key]}, this run has "
                                  f"{mine[key]} ({field} changed)", _RESTORE)
        theirs = {s["name"]: s["windows"] for s in state.get("sources", [])}
        if bool(theirs) != self.mixture or (theirs and set(theirs) != {s.name for s in self.sources}):
            was = ", ".join(theirs) if theirs else "one source (data.path)"
            now = ", ".join(s.name for s in self.sources) if self.mixture else "one source (data.path)"
            raise ConfigError("data.sources", f"the checkpoint was written for {was}, this run has {now}", _RESTORE)
        if not self.mixture:
            if state.get("num_windows") != mine["num_windows"]:
                raise ConfigError("data.path", f"the checkpoint was written with num_windows={state['num_windows']}, this "
                                  f"run has {mine['num_windows']} (the corpus or tokenizer changed)", _RESTORE)
            return None
        by_name = {s.name: (s, w) for s, w in zip(self.sources, self.windows)}
        for name, windows in theirs.items():
            if by_name[name][1] != windows:
                raise ConfigError(by_name[name][0].field, f"source {name!r} had {windows} windows when the checkpoint was "
                                  f"written, {by_name[name][1]} now (its files or the tokenizer changed)", _RESTORE)
        order = [s["name"] for s in state["sources"]]
        self.sources = [by_name[n][0] for n in order]
        self.windows = [by_name[n][1] for n in order]
        self._perms = {}
        before = Blend.from_state(state["blend"])
        self.blend = before.reweighted([s.weight for s in self.sources], step * self.global_batch)
        if self.blend is before:
            return None
        old, new = before.segments[-1].weights, self.blend.segments[-1].weights
        counts = self.blend.segments[-1].base
        changes = ", ".join(f"{n} {_share(old, i):.3g} -> {_share(new, i):.3g}" for i, n in enumerate(order))
        read = ", ".join(f"{n} {c:,}" for n, c in zip(order, counts))
        return (f"data: mixture weights changed at step {step} (shares of the samples: {changes}); each source goes on "
                f"where it was, nothing read again or skipped (samples read so far: {read})")


def check_batches(data: PreparedData, cfg, trainer_state: dict | None = None, epochs: bool = True) -> TokenBatches:
    """Before any process starts (cli.py): the batches can be drawn — one global batch at least, and the data
    a resumed checkpoint was written for (`trainer_state`, its trainer_state.json) — and (`epochs`) no source
    of a mixture is read over more than its max_epochs by train.steps, from where the run resumes."""
    t = cfg.train
    if data.finetune and cfg.parallel.tp_mode == "2d":
        raise ConfigError("parallel.tp_mode", "fine-tuning records put the loss on some tokens only, and the 2-D "
                          "tensor-parallel cross-entropy (parallel/tensor2d.py) counts every token",
                          'use parallel.tp_mode = "1d" for fine-tuning')
    batches = TokenBatches(batch_sources(data, t.seq_len, cfg.data.loss_on), t.seq_len, t.global_batch, t.seed)
    if trainer_state is not None and cfg.checkpoint.resume and "data" in trainer_state:
        batches.load_state(trainer_state["data"], trainer_state.get("step", 0))
    if epochs:
        batches.check_epochs(t.steps)
    return batches


def _share(weights: tuple[float, ...], i: int) -> float:
    return weights[i] / sum(weights)


_RESTORE = "restore the original setting, or start a fresh run (checkpoint.resume=false or another checkpoint.dir)"
