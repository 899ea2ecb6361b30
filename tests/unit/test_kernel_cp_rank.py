"""benchmarks/kernels.py times one context-parallel rank's attention as torch's load-balanced ring computes it
(kernel_sdpa_lengths.rank_calls): that rank's calls must cover exactly the causal (query, key) pairs its queries
own over the whole sequence, each once, for the timing to be the rank's work (issue 60's CP 4-8 rows)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from kernel_sdpa_lengths import rank_calls  # noqa: E402


def _positions(rank: int, cp: int, chunk: int) -> torch.Tensor:
    """Token positions a rank holds under round-robin load balance: chunk `rank` and its mirror 2 cp - 1 - rank,
    laid out as a (batch, heads, seq, 1) tensor so that the calls' slices along the sequence slice positions."""
    first, last = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(last, last + chunk)]).view(1, 1, -1, 1)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_a_ring_ranks_calls_cover_its_causal_pairs_exactly_once(cp):
    chunk = 3
    for rank in range(cp):
        queries = _positions(rank, cp, chunk)
        seen: list[tuple[int, int]] = []
        for step in range(cp):  # step i attends to the K/V of rank (rank - i) mod cp, as the ring delivers them
            keys = _positions((rank - step) % cp, cp, chunk)
            q, k, _, causal, partial = rank_calls(queries, keys, keys, cp, rank)[step]
            assert partial == (step > rank)  # only the second query chunk's outputs
            qs, ks = q.flatten().tolist(), k.flatten().tolist()
            seen += [(a, b) for i, a in enumerate(qs) for j, b in enumerate(ks) if not causal or j <= i]
        owned = [(a, b) for a in queries.flatten().tolist() for b in range(2 * cp * chunk) if b <= a]
        assert sorted(seen) == sorted(owned), (cp, rank)  # every needed pair, none twice, none masked


def test_every_rank_does_the_same_work():
    """Load balance: each rank's calls hold the same number of (query, key) pairs, 1/cp of the causal half."""
    cp, chunk = 4, 8
    sizes = set()
    for rank in range(cp):
        q = _positions(rank, cp, chunk)
        sizes.add(sum(qi.shape[2] * ki.shape[2] // (2 if causal else 1)
                      for qi, ki, _, causal, _ in rank_calls(q, q, q, cp, rank)))
    assert len(sizes) == 1
