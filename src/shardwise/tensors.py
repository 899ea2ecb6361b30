"""The one torch helper every floor above it shares: what a rank actually holds of a tensor."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank stores; autograd flows through it and its gradient
    keeps the DTensor's placements), any other tensor unchanged."""
    return t.to_local() if isinstance(t, DTensor) else t
