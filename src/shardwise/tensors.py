"""The torch helpers every floor above it shares: what a rank actually holds of a tensor, and a sum over
a process group that autograd can differentiate."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank stores; autograd flows through it and its gradient
    keeps the DTensor's placements), any other tensor unchanged."""
    return t.to_local() if isinstance(t, DTensor) else t


class _GroupSum(torch.autograd.Function):
    """Sum over a process group whose backward sums the gradients over the group too (the adjoint
    of a sum that every rank consumes). Ours because torch.distributed.nn's is deprecated and the
    functional all_reduce has no autograd formula."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def group_sum(x: torch.Tensor, group) -> torch.Tensor:
    """x summed over `group` on every member, differentiably (models/moe.py's load-balancing
    statistics, parallel/tensor2d.py's RMSNorm sums of squares)."""
    return _GroupSum.apply(x, group)
