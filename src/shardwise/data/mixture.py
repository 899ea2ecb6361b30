"""Which source each training sample of a mixture comes from, as a closed form of the sample's number.

Sample n of the global stream (step s, row r: n = s x global_batch + r) is drawn from one source, and is
the next unread sample of that source's own stream. Over any run of samples each source's share is its
weight to within one sample per level of a binary tree over the sources: at each node the samples
arriving there are split left / right like Bresenham's line, the k-th going left iff
floor((k + 1) p + 1/2) > floor(k p + 1/2), p the left subtree's share of the node's weight. So the
number of samples a source has had after n samples is a few integer divisions (no replay of the stream,
whatever n), exact (p is a fraction), and never decreases: nothing read is read again or skipped.

Weights may change when a run resumes. The stream is then a list of segments: from sample n0 on, with
new weights, each source going on from the count it had reached at n0. What is consumed is a function
of the seed, the sources and the segments — never of the layout or the world size — so a resume on
another number of GPUs, or an elastic resize, reads exactly the samples a run without it would.
Megatron-LM's BlendedDataset draws the same greedy proportions but must rebuild its index (and repeats
or skips samples) when weights change (NVIDIA/Megatron-LM#457).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from shardwise.errors import ConfigError

# A split's share is a fraction with a denominator of at most this: weights are followed to 1e-6, and
# 2 k a stays within int64 up to k = 2^40 samples (a trillion: 4,000 years of 8M-sample days).
_DENOMINATOR = 1 << 20
MAX_SAMPLES = 1 << 40


@dataclass(frozen=True)
class _Node:
    left: _Node | int
    right: _Node | int
    a: int  # the left share p = a / b
    b: int


def _tree(weights: list[Fraction], ids: list[int]) -> _Node | int:
    if len(ids) == 1:
        return ids[0]
    mid = len(ids) // 2
    wl = sum((weights[i] for i in ids[:mid]), Fraction(0))
    wr = sum((weights[i] for i in ids[mid:]), Fraction(0))
    p = (wl / (wl + wr)).limit_denominator(_DENOMINATOR)
    return _Node(_tree(weights, ids[:mid]), _tree(weights, ids[mid:]), p.numerator, p.denominator)


def _left(k, a: int, b: int):
    """Samples that went left among the first k reaching a node: floor(k a / b + 1/2)."""
    return (2 * k * a + b) // (2 * b)


@dataclass(frozen=True)
class Segment:
    start: int  # its first sample
    weights: tuple[float, ...]  # as configured (normalised where used)
    base: tuple[int, ...]  # samples each source had had before `start`

    def as_dict(self) -> dict:
        return {"start": self.start, "weights": list(self.weights), "base": list(self.base)}


class Blend:
    """The source and per-source index of every sample, over one or more segments of weights."""

    def __init__(self, names: list[str], segments: list[Segment]):
        self.names = list(names)
        self.segments = list(segments)
        self._trees = [_tree([Fraction(w) for w in s.weights], list(range(len(names)))) for s in segments]

    @classmethod
    def start(cls, names: list[str], weights: list[float]) -> Blend:
        return cls(names, [Segment(0, tuple(weights), (0,) * len(names))])

    # ---- what the stream holds
    def _segment(self, n: int) -> int:
        return max(i for i, s in enumerate(self.segments) if s.start <= n)

    def assign(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index within that source's stream) of each sample number."""
        samples = np.asarray(samples, dtype=np.int64)
        if len(samples) and int(samples.max()) >= MAX_SAMPLES:
            raise ValueError(f"sample {int(samples.max())} is past the mixture's range ({MAX_SAMPLES})")
        source = np.empty(len(samples), dtype=np.int64)
        index = np.empty(len(samples), dtype=np.int64)
        starts = np.array([s.start for s in self.segments], dtype=np.int64)
        which = np.searchsorted(starts, samples, side="right") - 1
        for i in np.unique(which):
            mask = which == i
            seg = self.segments[int(i)]
            src, idx = self._descend(self._trees[int(i)], samples[mask] - seg.start)
            source[mask] = src
            index[mask] = idx + np.asarray(seg.base, dtype=np.int64)[src]
        return source, index

    def _descend(self, node, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(node, int):
            return np.full(len(k), node, dtype=np.int64), k
        before = _left(k, node.a, node.b)
        goes_left = _left(k + 1, node.a, node.b) > before
        src = np.empty(len(k), dtype=np.int64)
        idx = np.empty(len(k), dtype=np.int64)
        for mask, child, sub in ((goes_left, node.left, before), (~goes_left, node.right, k - before)):
            if mask.any():
                src[mask], idx[mask] = self._descend(child, sub[mask])
        return src, idx

    def consumed(self, n: int) -> list[int]:
        """Samples each source has given among the stream's first n."""
        seg = self.segments[self._segment(n)] if n > 0 else self.segments[0]
        counts = list(seg.base)
        self._count(self._trees[self.segments.index(seg)], n - seg.start, counts)
        return counts

    def _count(self, node, k: int, counts: list[int]) -> None:
        if isinstance(node, int):
            counts[node] += k
            return
        left = _left(k, node.a, node.b)
        self._count(node.left, left, counts)
        self._count(node.right, k - left, counts)

    # ---- changes on resume
    def reweighted(self, weights: list[float], at: int) -> Blend:
        """This blend with `weights` from sample `at` on (the same blend when they did not change)."""
        if tuple(weights) == self.segments[-1].weights:
            return self
        kept = [s for s in self.segments if s.start < at]
        return Blend(self.names, [*kept, Segment(at, tuple(weights), tuple(self.consumed(at)))])

    def state(self) -> dict:
        return {"sources": self.names, "segments": [s.as_dict() for s in self.segments]}

    @classmethod
    def from_state(cls, state: dict) -> Blend:
        return cls(state["sources"], [Segment(s["start"], tuple(s["weights"]), tuple(s["base"])) for s in state["segments"]])


def check_epochs(names: list[str], fields: list[str], windows: list[int], max_epochs: list[float], blend: Blend,
                 total_samples: int, steps: int) -> None:
    """ConfigError when train.steps would read a source over more times than its max_epochs allows."""
    used = blend.consumed(total_samples)
    for i, name in enumerate(names):
        if max_epochs[i] <= 0:
            continue
        epochs = used[i] / windows[i]
        if epochs > max_epochs[i] + 1e-9:
            share = blend.segments[-1].weights[i] / sum(blend.segments[-1].weights)
            raise ConfigError(fields[i], f"source {name!r} would be read {epochs:.2f} times over by train.steps={steps} "
                              f"(its share {share:.3f} takes {used[i]:,} samples of its {windows[i]:,}), more than its "
                              f"max_epochs={max_epochs[i]:g}",
                              "lower its weight, give it more data, raise its max_epochs, or train fewer steps")
