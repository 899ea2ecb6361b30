"""Fine-tuning records packed whole into rows of seq_len + 1 tokens (best fit), the rows a source gives.

Pre-training reads a corpus as one stream cut into windows; a fine-tuning record cut by a window would
lose its prompt or its answer. So each row holds whole records, and the rest of the row is padding: the
end-of-document token without loss (so the pads are one-token documents of their own under
train.document_mask, and carry no loss under either data.loss_on). Records are packed best-fit
decreasing (the longest first, each into the fullest row it fits; Johnson's bound: at most 11/9 of the
optimal rows plus a few), as Megatron-LM's and TRL's packers do; the packing depends only on the records'
lengths and seq_len, so every rank, worker and run computes the same rows. A record longer than a row
is cut to the row (counted: the start-up line names how many).

PackedRows reads like a TokenStream to train/data.py TokenBatches: "window" k (tokens from k * seq_len)
is row k, and its length (rows * seq_len + 1) gives TokenBatches exactly `rows` windows, which it
permutes per epoch as it permutes a stream's windows.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardwise.data.shards import TokenStream, index_arrays


@dataclass(frozen=True)
class PackingFacts:
    records: int
    rows: int
    row_tokens: int  # seq_len + 1
    cut: int  # records longer than a row
    loss_tokens: int  # in the rows, after cutting (under data.loss_on)
    pad_tokens: int

    def line(self, loss_on: str) -> str:
        total = self.rows * self.row_tokens
        cut = f", {self.cut:,} record{'' if self.cut == 1 else 's'} longer than a row cut to it" if self.cut else ""
        return (f"{self.records:,} records packed into {self.rows:,} rows of {self.row_tokens} tokens (best fit, "
                f"{self.records / max(self.rows, 1):.1f} a row): loss on {100 * self.loss_tokens / total:.1f}% of the "
                f"tokens (data.loss_on={loss_on}), padding {100 * self.pad_tokens / total:.1f}%{cut}")


def loss_targets(rows: np.ndarray) -> int:
    """The targets that carry loss in (n, seq_len + 1) rows, flags in the sign (data/finetune.py): a row's
    first token is no token's target."""
    return int(np.count_nonzero(rows[..., 1:] >= 0))


def best_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Rows of record indices: best-fit decreasing, ties by index (deterministic)."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, row), sorted: the fullest row that fits is a bisect away
    for i in order:
        n = int(lengths[i])
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            space, row = free.pop(at)
        else:
            space, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        if space - n > 0:
            bisect.insort(free, (space - n, row))
    return rows


class PackedRows:
    """A fine-tuning stream's records packed into rows (see the module's docstring)."""

    def __init__(self, stream: TokenStream, seq_len: int, loss_on: str, eod: int):
        self.stream, self.seq_len, self.loss_on, self.eod = stream, seq_len, loss_on, eod
        lengths = np.concatenate([index_arrays(Path(b).with_suffix(".idx"))[0] for b in stream.bins]
                                 or [np.zeros(0, np.int32)]).astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) \
            else np.zeros(0, dtype=np.int64)
        self.lengths = np.minimum(lengths, seq_len + 1)
        rows = best_fit(self.lengths, seq_len + 1)
        self.row_ptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=self.row_ptr[1:])
        self.row_records = np.fromiter((i for r in rows for i in r), dtype=np.int64, count=int(self.row_ptr[-1]))
        self.cut = int(np.count_nonzero(lengths > seq_len + 1))

    @property
    def rows(self) -> int:
        return len(self.row_ptr) - 1

    def __len__(self) -> int:
        return self.rows * self.seq_len + 1

    def row(self, r: int) -> np.ndarray:
        """Row r's tokens, loss flags in the sign (data/finetune.py); pads are ~eod (no loss)."""
        out = np.full(self.seq_len + 1, ~self.eod, dtype=np.int64)
        at = 0
        for i in self.row_records[self.row_ptr[r]:self.row_ptr[r + 1]]:
            n = int(self.lengths[i])
            out[at:at + n] = self.stream.read(int(self.starts[i]), int(self.starts[i]) + n)
            at += n
        if self.loss_on == "all":  # every record token carries loss; the pads stay without
            out[:at] = np.where(out[:at] < 0, ~out[:at], out[:at])
        return out

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """TokenBatches' read: window starts k * seq_len are rows k (length is seq_len + 1)."""
        assert length == self.seq_len + 1, (length, self.seq_len)
        return np.stack([self.row(int(k)) for k in np.asarray(starts) // self.seq_len]) if len(starts) \
            else np.zeros((0, length), dtype=np.int64)

    def facts(self) -> PackingFacts:
        """The start-up line's figures; reads every row once."""
        loss = sum(loss_targets(self.row(r)) for r in range(self.rows))
        return PackingFacts(len(self.lengths), self.rows, self.seq_len + 1, self.cut, loss,
                            self.rows * (self.seq_len + 1) - int(self.lengths.sum()))


def source_rows(stream: TokenStream, finetune: bool, seq_len: int, loss_on: str, eod: int):
    """What a source's batches read: its stream, or a fine-tuning corpus's packed rows."""
    return PackedRows(stream, seq_len, loss_on, eod) if finetune else stream


def sampled_document_starts(rows, seq_len: int, eod: int, count: int = 256) -> list[list[int]]:
    """Where the documents of up to `count` rows start, rows spread evenly over a source (`rows`: what
    source_rows returns): what the document mask's price (spec/documents.py) is measured on. The rows are the
    training rows' inputs (their first seq_len tokens), signs decoded as the trainer decodes them, so a fine-tuning
    row's pads count as the one-token documents the trainer's mask makes of them."""
    windows = (len(rows) - 1) // seq_len
    if windows < 1:
        return []
    picks = np.unique(np.linspace(0, windows - 1, num=min(count, windows)).astype(np.int64))
    tokens = rows.windows(picks * seq_len, seq_len + 1)[:, :seq_len]
    tokens = np.where(tokens < 0, ~tokens, tokens)
    return [[0, *(np.flatnonzero(row[:-1] == eod) + 1).tolist()] for row in tokens]
