"""How model states are divided among the ranks that shard them, in closed form (no torch): shared by
the trainer (parallel/zero1.py) and the planner (plan/memory.py), so both place every tensor alike."""
from __future__ import annotations

import heapq


def zero1_owners(groups: tuple[tuple[int, ...], ...] | list[list[int]], n: int) -> list[int]:
    """ZeroRedundancyOptimizer's greedy partition, which parallel/zero1.py runs for the trainer and
    plan/memory.py prices: each
    tensor (by element count, largest first, stable) to the least-loaded rank, ties to the lowest
    rank, per param group with loads carried over. Returns the owner of every tensor, groups
    flattened in order."""
    loads = [(0, r) for r in range(n)]
    heapq.heapify(loads)
    owners: list[int] = []
    for group in groups:
        owner = [0] * len(group)
        for i in sorted(range(len(group)), key=lambda i: -group[i]):
            elems, r = heapq.heappop(loads)
            owner[i] = r
            heapq.heappush(loads, (elems + group[i], r))
        owners += owner
    return owners
