"""The DeviceMeshes of a run, built from spec/dims.py's ParallelDims: the root mesh over the enabled
axes and its named views (batch, gradient, sharding, HSDP, expert).

Axes of size 1 create no process group; on one process there is no mesh at all (the reference path
runs without any process group).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch.distributed as dist

from shardwise.spec.dims import ParallelDims

EXPERT_AXES = ("pp", "dp_replicate", "efsdp", "ep", "tp")


@dataclass(frozen=True)
class Meshes:
    """The root mesh (index it by axis names) and the 1-D batch view over dp_replicate x dp_shard:
    the ranks that read different data (None when there is one such rank). With cp > 1 also the
    gradient view `dp_cp` (dp_replicate x dp_shard x cp: gradient and loss averaging), the sharding
    view `dp_shard_cp` (dp_shard x cp: FSDP / ZeRO-1) and, with dp_replicate > 1, `hsdp_cp`, the
    2-D (dp_replicate, dp_shard_cp) mesh of HSDP; all None when cp == 1."""

    root: object
    batch: object | None
    dp_cp: object | None = None
    dp_shard_cp: object | None = None
    hsdp_cp: object | None = None
    expert: object | None = None  # the (efsdp, ep) expert mesh (build_expert_mesh); None without EP
    tp_grid: object | None = None  # tp_mode "2d": the (tp_row, tp_col) q x q grid over the tp axis (build_tp_grid)

    def __getitem__(self, names):
        return self.root[names]


class _ScalarRedistributeNote(logging.Filter):
    """torch 2.13's DTensor logs a ~500-character note, on every rank, when a redistribution takes one
    collective per mesh axis. On our layouts it meets two: the gradient norm over FSDP x TP (a
    (_NormPartial, _NormPartial) scalar: two all-reduces of 4 bytes) and the full weights gathered from
    strided FSDP x TP shards for a checkpoint or an export (once per save). Neither is a step's cost and
    the advice it gives (flatten mesh axes) is not the user's to take: every TP / CP / MoE run printed it
    4-8 times. Any other such note still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("sequential" in message and ("_NormPartial" in message or "_StridedShard" in message))


def quiet_scalar_redistribute_notes() -> None:
    """Install the filter above once per process (the logger is torch's: process-wide by nature)."""
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    if not any(isinstance(f, _ScalarRedistributeNote) for f in logger.filters):
        logger.addFilter(_ScalarRedistributeNote())


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes | None:
    """The DeviceMesh over the enabled axes and its named views. None on one process."""
    from torch.distributed.device_mesh import init_device_mesh

    axes = dims.enabled_axes()
    if not axes:
        return None
    quiet_scalar_redistribute_notes()
    if dims.world_size == 1:
        join_one_rank_group(device_type)
    root = init_device_mesh(device_type, tuple(getattr(dims, a) for a in axes), mesh_dim_names=tuple(axes))
    batch = None
    if dims.dp_replicate > 1 and dims.dp_shard > 1:
        # Keep the flattened view itself: slicing it back out of the root mesh is deprecated.
        batch = root["dp_replicate", "dp_shard"]._flatten("dp")
    elif dims.dp > 1:
        batch = root["dp_replicate" if dims.dp_replicate > 1 else "dp_shard"]
    expert = build_expert_mesh(dims, device_type)
    grid = build_tp_grid(root, dims)
    if dims.cp == 1:
        return Meshes(root, batch, expert=expert, tp_grid=grid)
    # CP ranks hold the same weights but see other tokens: gradients are averaged over
    # dp_replicate x dp_shard x cp and model states sharded over dp_shard x cp (torchtitan's
    # "dp_cp" / "dp_shard_cp"). A flattened view of one non-trivial axis is that axis (DeviceMesh
    # returns the same group), and it keeps that axis's name, as the planner does (plan/comm.py).
    shard_cp = root["dp_shard", "cp"]._flatten("dp_shard_cp") if dims.dp_shard > 1 else root["cp"]
    if dims.dp_replicate == 1:
        grad = shard_cp
    else:
        grad = root[tuple(a for a in ("dp_replicate", "dp_shard", "cp") if getattr(dims, a) > 1)]._flatten("dp_cp")
    # HSDP with CP: FSDP2's 2-D mesh (replicate, shard) with the shard dim over dp_shard x cp.
    # With dp_shard > 1 this slices the flattened dim back out of the root mesh, which torch
    # warns will be deprecated; it reuses the existing groups (a fresh 2-D DeviceMesh would
    # create new communicators). Parity: tests/parity/matrix.py cp2_hsdp_2x2_zero3.
    hsdp = root["dp_replicate", shard_cp.mesh_dim_names[0]] if dims.dp_replicate > 1 else None
    return Meshes(root, batch, grad, shard_cp, hsdp, expert, grid)


def build_tp_grid(root, dims: ParallelDims):
    """tp_mode "2d": the tp axis unflattened row-major into a (tp_row, tp_col) = (q, q) mesh (a grid row
    is q consecutive tp ranks), kept in the root mesh's family so FSDP2 composes dp with it; None
    otherwise. Its axes get process groups of their own (parallel/tensor2d.py)."""
    if dims.tp_mode != "2d" or dims.tp == 1:
        return None
    q = math.isqrt(dims.tp)
    return root._unflatten("tp", (q, q), ("tp_row", "tp_col"))["tp_row", "tp_col"]


def join_one_rank_group(device_type: str) -> None:
    """A default process group of this process alone, for a one-process run that needs a mesh:
    offload on one device is FSDP2 over a 1-rank dp_shard axis (spec/dims.py enabled_axes), and a
    DeviceMesh is built on the default group. An in-memory HashStore suffices: there is no peer to
    meet. Kept for the life of the process; a later one-process run reuses it."""
    if dist.is_initialized():
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def expert_axis_sizes(dims: ParallelDims) -> dict[str, int]:
    """Experts live on the dp_shard x cp ranks, reshaped row-major into (efsdp, ep): ep innermost,
    efsdp the ranks that hold the same experts (parallel/expert.py)."""
    return {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "efsdp": dims.shard_group // dims.ep, "ep": dims.ep,
            "tp": dims.tp}


def build_expert_mesh(dims: ParallelDims, device_type: str):
    """The (.., efsdp, ep, ..) DeviceMesh, or None without expert parallelism."""
    if dims.ep == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    sizes = expert_axis_sizes(dims)
    names = tuple(a for a in EXPERT_AXES if sizes[a] > 1 or a == "ep")
    # A backend for every axis makes DeviceMesh create a group of its own even when an axis spans the
    # whole world (it would otherwise reuse the default group, which the root mesh's axis may already
    # use): the communication counter names groups by axis, so "ep" must not share one with dp_shard.
    backend = dist.get_backend()
    return init_device_mesh(device_type, tuple(sizes[a] for a in names), mesh_dim_names=names,
                            backend_override={a: backend for a in names})
