"""Gradient compression's constants and per-tensor counts, shared by the DDP hooks
(parallel/grad_compression.py) and the planner (plan/compression.py), so both count the same elements.
Torch-free."""
from __future__ import annotations

import math

METHODS = ("none", "bf16", "int8", "topk", "powersgd")
# int8: one fp32 scale per chunk of this many entries (block-wise absmax, as in Dettmers et al. 2021,
# 8-bit optimizers): an outlier only coarsens its own chunk; the scales cost 4/1024 of a byte per entry.
INT8_CHUNK = 1024
INT8_LEVELS = 127  # symmetric: -127..127
TOPK_ENTRY_BYTES = 8  # fp32 value + int32 index
# torch's PowerSGDState default: a matrix is compressed only when (n + m) r x 2 < n m.
POWERSGD_MIN_COMPRESSION_RATE = 2


def topk_count(n: int, ratio: float) -> int:
    """Entries topk sends of a bucket of n: ceil(ratio x n), at least 1 and at most n."""
    return max(1, min(n, math.ceil(ratio * n)))


def int8_chunks(n: int) -> int:
    return max(1, math.ceil(n / INT8_CHUNK))


def powersgd_elements(shape: tuple[int, ...], rank: int) -> tuple[int, int, int]:
    """(uncompressed entries, P entries, Q entries) torch's powerSGD_hook all-reduces for one gradient
    of `shape`: a 1-D tensor, or a matrix (shape[0], rest) it would not shrink by
    min_compression_rate, goes whole; else rank r' = min(n, m, r) factors P (n x r') and Q (m x r')."""
    total = 1
    for d in shape:
        total *= d
    if len(shape) <= 1:
        return total, 0, 0
    n, m = shape[0], total // shape[0]
    r = min(n, m, rank)
    if (n + m) * r * POWERSGD_MIN_COMPRESSION_RATE < n * m:
        return 0, n * r, m * r
    return total, 0, 0
