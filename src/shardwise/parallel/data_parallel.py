"""The data-parallel family: DDP, ZeRO-1, ZeRO-2/3 (FSDP2 `fully_shard`), HSDP, CPU offload.

parallel.zero says what is sharded over the dp_shard axis (Rajbhandari et al. 2019, arXiv 1910.02054):
  0  nothing — DDP over dp_replicate (dp_shard must be 1)
  1  optimizer state — DDP all-reduce over all dp ranks + ZeroOneOptimizer (parallel/zero1.py) over dp_shard
  2  + gradients — FSDP2 with reshard_after_forward=False (parameters stay gathered until backward)
  3  + parameters — FSDP2 with reshard_after_forward=True
dp_replicate > 1 with zero >= 2 is HSDP: FSDP2 on the 2-D (dp_replicate, dp_shard) mesh shards
inside a replica group and all-reduces across groups.

Context parallel (cp > 1): cp ranks hold the same parameters but see different tokens of the same
sequences, so for gradients they are data-parallel ranks too: DDP / replicate average over dp_cp
(dp_replicate x dp_shard x cp) and FSDP / ZeRO-1 shard over dp_shard_cp (dp_shard x cp), as
torchtitan does. Every rank's loss is its tokens' sum over its local tokens per step, so the
average over dp_cp is the global token mean (train/trainer.py).

Which wrapper a layout gets is ParallelDims.wrapper(zero) (spec/dims.py: "fsdp", "ddp", "replicate" or
"none"; the planner reads the same choice). parallelize.py applies it; gradient_sync() below is how
the trainer drives it over a step's micro-batches without knowing which one it is.
"""
from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardwise.config import ParallelConfig
from shardwise.parallel.precision import fsdp_mp_policy
from shardwise.spec.dims import ParallelDims


def dp_mesh(mesh, dims: ParallelDims):
    """The mesh view FSDP2 shards over: 2-D (replicate, shard) for HSDP, else the dp_shard axis
    (with CP: dp_shard x cp)."""
    if dims.cp > 1:
        return mesh.hsdp_cp if dims.dp_replicate > 1 else mesh.dp_shard_cp
    if dims.dp_replicate > 1 and dims.dp_shard > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def gradient_mesh(mesh):
    """The ranks gradients (and the logged loss) are averaged over: the batch view, or with CP
    dp_cp; None on one rank."""
    if mesh is None:
        return None
    return mesh.dp_cp if mesh.dp_cp is not None else mesh.batch


def gradient_group(mesh) -> "dist.ProcessGroup | None":
    view = gradient_mesh(mesh)
    return view.get_group() if view is not None else None


def apply_fsdp(model: nn.Module, mesh, dims: ParallelDims, p: ParallelConfig, precision: str) -> None:
    """ZeRO-2/3 and HSDP with FSDP2, one FSDP unit per transformer block plus the root.

    Per-block units let the all-gather of block i+1 overlap the compute of block i. The root unit
    (embedding, final norm, output head) is not resharded after forward: backward needs it first,
    so resharding it would only add an all-gather (torchtitan does the same).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    kwargs = dict(mesh=dp_mesh(mesh, dims), mp_policy=fsdp_mp_policy(precision, p.grad_compression),
                  # Pinned host memory speeds up GPU<->CPU copies; it needs an accelerator to exist.
                  offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if dims.offload else OffloadPolicy())
    reshard = p.zero == 3
    # Expert parallelism: experts get their own units over efsdp first, or are left out (expert.py).
    from shardwise.parallel.expert import shard_experts

    ignored = shard_experts(model, getattr(mesh, "expert", None), dims, reshard, kwargs)
    if ignored:
        kwargs["ignored_params"] = ignored
    for block in model.blocks():
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)


def apply_replicate(model: nn.Module, mesh, precision: str, grad_compression: str = "none") -> None:
    """DDP for layouts whose parameters are DTensors (tp > 1) and for pipeline stages.
    DistributedDataParallel buckets plain tensors and cannot reduce DTensor gradients, so these
    layouts use PyTorch's FSDP2-based
    `replicate`: the same per-block units as apply_fsdp, gradients all-reduced over the batch view,
    nothing sharded."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    mp_policy = fsdp_mp_policy(precision, grad_compression)
    for block in model.blocks():
        replicate(block, mesh=gradient_mesh(mesh), mp_policy=mp_policy)
    replicate(model, mesh=gradient_mesh(mesh), mp_policy=mp_policy)


def apply_ddp(model: nn.Module, mesh, dims: ParallelDims, p: ParallelConfig | None = None) -> nn.Module:
    """DDP over every data-parallel rank (for ZeRO-1 too: gradients are all-reduced, only the
    optimizer state is sharded). Buckets of 25 MB overlap the all-reduce with backward. Buffers
    (RoPE tables) are computed identically on every rank, so they are not re-synced each forward.
    parallel.grad_compression registers its communication hook (parallel/grad_compression.py); the
    hook's state, which checkpoints save, is the wrapper's `grad_compression_state` (None when stateless)."""
    from shardwise.parallel.grad_compression import register_compression

    device = next(model.parameters()).device
    ddp = DistributedDataParallel(
        model, process_group=gradient_group(mesh), bucket_cap_mb=25, forward_sync_buffers=False,
        gradient_as_bucket_view=True, device_ids=[device.index] if device.type == "cuda" else None)
    ddp.grad_compression_state = register_compression(model, ddp, gradient_group(mesh), p) if p is not None else None
    return ddp


def zero1_group(mesh, dims: ParallelDims) -> "dist.ProcessGroup":
    return (mesh.dp_shard_cp if dims.cp > 1 else mesh["dp_shard"]).get_group()


class GradientSync:
    """When the gradients of a step's micro-batches are reduced over the data-parallel ranks: the
    trainer's one question to the wrapper, asked as `with sync.micro_batch(i, m):` around the forward
    and backward of micro-batch i of m. This base reduces each micro-batch's gradients as its backward
    produces them (nothing to switch off), which is right for:
      - ZeRO-3: it reduce-scatters after every micro-batch, because holding unsharded gradients
        across accumulation would undo the memory saving it is chosen for;
      - pipeline stages: the schedule drives FSDP2-family modules' reduction itself (once per step,
        after the last micro-batch's backward) for every stage a rank holds;
      - one data-parallel rank: there is nothing to reduce."""

    def micro_batch(self, index: int, count: int) -> AbstractContextManager:
        return contextlib.nullcontext()


class DDPSync(GradientSync):
    """DistributedDataParallel: accumulate locally under no_sync() and all-reduce once, in the last
    micro-batch's backward."""

    def __init__(self, model: DistributedDataParallel):
        self.model = model

    def micro_batch(self, index: int, count: int) -> AbstractContextManager:
        return contextlib.nullcontext() if index == count - 1 else self.model.no_sync()


class FlagSync(GradientSync):
    """FSDP2 with ZeRO-2 (HSDP included) and FSDP2's `replicate`: the module's gradient-sync flag is
    off for all but the last micro-batch, so the step's reduction runs once. The last micro-batch
    turns it back on, so nothing is left to undo when the step ends."""

    def __init__(self, model: nn.Module):
        self.model = model

    def micro_batch(self, index: int, count: int) -> AbstractContextManager:
        self.model.set_requires_gradient_sync(index == count - 1)
        return contextlib.nullcontext()


def gradient_sync(model: nn.Module, dims: ParallelDims, p: ParallelConfig) -> GradientSync:
    """The GradientSync of `model` (as build_parallel_model / build_pipeline returned it) for this
    layout, chosen once from the wrapper ParallelDims.wrapper names."""
    wrapper = dims.wrapper(p.zero)
    zero3 = wrapper == "fsdp" and p.zero == 3
    if dims.pp > 1 or wrapper == "none" or zero3:
        return GradientSync()
    if wrapper == "ddp":
        return DDPSync(model)
    return FlagSync(model)  # replicate, or fsdp with zero 2


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model
