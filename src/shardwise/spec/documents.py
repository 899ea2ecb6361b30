"""What document masking (train.document_mask) executes of attention: the planner's price and the trainer's
start-up line read it from here, so they agree. Torch-free.

A block-sparse kernel (FlexAttention, Dong et al. 2024, arXiv 2412.05496; 128 x 128 blocks by default) computes
a (query block, key block) tile when any query of the block may see any key of the tile, and skips it
otherwise. Documents are contiguous, so the keys that query block i sees run from the start of the document
of its first query to the block's end: key blocks floor(start / B) .. i, every one of them computed (a tile that
the mask only partly empties costs a whole tile). Causal attention over the whole row computes blocks 0 .. i.
The planner prices causal attention already (plan/constants.py CAUSAL_EXECUTED_FRACTION), so the document
mask is a share of that: masked tiles / causal tiles, over rows of the run's own data.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

FLEX_BLOCK = 128  # torch.nn.attention.flex_attention's default BLOCK_SIZE (create_block_mask)


def causal_tiles(seq_len: int, block: int = FLEX_BLOCK) -> int:
    """Tiles a causal block-sparse kernel computes for one row: n (n + 1) / 2 for n query blocks."""
    n = math.ceil(seq_len / block)
    return n * (n + 1) // 2


def document_tiles(starts: Sequence[int], seq_len: int, block: int = FLEX_BLOCK) -> int:
    """Tiles computed for one row whose documents start at the sorted offsets `starts` (0 first), under the
    document mask (module docstring)."""
    total, doc = 0, 0
    for i in range(math.ceil(seq_len / block)):
        first = i * block
        while doc + 1 < len(starts) and starts[doc + 1] <= first:
            doc += 1
        total += i - starts[doc] // block + 1
    return total


@dataclass(frozen=True)
class DocumentShare:
    """Masked tiles over causal tiles, over `rows` sampled rows of `seq_len` tokens holding `documents` starts."""

    share: float
    rows: int
    documents: int
    seq_len: int

    @property
    def mean_document_tokens(self) -> float:
        return self.rows * self.seq_len / max(1, self.documents)

    def line(self) -> str:
        return (f"document mask: attention computes {100 * self.share:.0f}% of causal attention's "
                f"{FLEX_BLOCK}-token tiles (FlexAttention's block mask; {self.rows} rows of the data sampled, "
                f"{self.mean_document_tokens:.0f} tokens a document in a row on average)")

    def to_json(self) -> dict:
        return {"share": self.share, "rows": self.rows, "documents": self.documents, "seq_len": self.seq_len,
                "block": FLEX_BLOCK}


def document_share(rows: Iterable[Sequence[int]], seq_len: int) -> DocumentShare:
    """The share of causal attention's tiles that the document mask computes over these rows' starts."""
    masked = causal = count = documents = 0
    for starts in rows:
        masked += document_tiles(starts, seq_len)
        causal += causal_tiles(seq_len)
        count += 1
        documents += len(starts)
    if count == 0:
        raise ValueError("no rows to measure the document mask on")
    return DocumentShare(masked / causal, count, documents, seq_len)
