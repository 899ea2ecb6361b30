"""Count the bytes every collective moves, per mesh axis and per kind (docs/architecture.md §5).

Counting happens at the process-group boundary: a TorchDispatchMode sees every c10d op (what DDP's
reducer, FSDP2 and the optimizers call) and every functional collective (what DTensor calls), with
the process group it runs on. Each group is named by the mesh axis it belongs to, so the counts
come out as {axis: {kind: bytes}} for one step.

Bytes are the *payload*: the size of the full logical buffer of a call, as one rank sees it —
all-reduce: the tensor; all-gather: the gathered output; reduce-scatter: the unsharded input;
broadcast / reduce / all-to-all / send / recv: the tensor. The planner predicts the same quantities
(shardwise.plan.comm.predict_comm_bytes) and converts them into the bytes a ring algorithm puts on
each link (shardwise.plan.comm.wire_bytes).
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# The trainer's own control group (train/control.py: skip/stop flags, checkpoint agreements) is named
# this and not counted: it is not training traffic, and the planner's bytes per axis leave it out.
CONTROL_AXIS = "control"
# op name (without overload) -> (kind, how to find the counted tensors in the args)
_KINDS = {
    # functional collectives (DTensor, loss parallel)
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast",
    # c10d ops (ProcessGroup methods: DDP, FSDP2, ZeroRedundancyOptimizer, dist.* calls)
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast", "reduce_": "reduce", "alltoall_base_": "all_to_all", "alltoall_": "all_to_all",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
}
# For these the counted buffer is the output (the gathered tensor), which is the first argument.
_OUTPUT_FIRST = {"_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_"}
# For these the counted buffer is the unsharded input, the second argument.
_INPUT_SECOND = {"_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"}


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def axis_names(mesh) -> dict[str, str]:
    """{process-group name: axis name} for every axis of `mesh` (a Meshes or DeviceMesh) and the
    flattened batch, dp_cp and dp_shard_cp views, the expert mesh's efsdp and ep axes, plus the
    default (world) group."""
    # Axes first: a group with the same ranks as an axis (but another name) is that axis, and a 1-D
    # mesh over the whole world may reuse the default group, which is then named by its axis.
    names: dict[str, str] = {}
    if mesh is not None:
        root = getattr(mesh, "root", mesh)
        for axis in root.mesh_dim_names:
            names[root[axis].get_group().group_name] = axis
        batch = getattr(mesh, "batch", None)
        if batch is not None and batch.mesh_dim_names[0] not in root.mesh_dim_names:
            names[batch.get_group().group_name] = "dp"
        # Context parallel's flattened views, under the planner's names (plan/comm.py batch_axis,
        # shard_axis); a view that is one axis (parallel/mesh.py build_meshes) keeps that axis's name.
        for view in (getattr(mesh, "dp_cp", None), getattr(mesh, "dp_shard_cp", None)):
            if view is not None:
                names.setdefault(view.get_group().group_name, view.mesh_dim_names[0])
        # 2-D tensor parallelism's grid axes (parallel/mesh.py build_tp_grid).
        grid = getattr(mesh, "tp_grid", None)
        if grid is not None:
            for axis in grid.mesh_dim_names:
                names[grid[axis].get_group().group_name] = axis
        # The expert mesh's own groups (parallel/expert.py builds them apart from the root's).
        expert = getattr(mesh, "expert", None)
        if expert is not None:
            for axis in ("efsdp", "ep"):
                if axis in expert.mesh_dim_names:
                    names[expert[axis].get_group().group_name] = axis
    if dist.is_initialized():
        names.setdefault(dist.group.WORLD.group_name, "world")
    return names


class CommCounter(TorchDispatchMode):
    """`with CommCounter(names) as c: ...` then `c.bytes` = {axis: {kind: payload bytes}} and
    `c.calls` = {axis: {kind: count}}. Works on every thread the mode is active on; autograd's CPU
    backward runs on the calling thread, and DDP's reducer calls its all-reduce from there."""

    def __init__(self, group_axes: dict[str, str]):
        super().__init__()
        self.group_axes = group_axes
        self.bytes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.calls: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def _axis(self, args, kwargs) -> str:
        values = (*args, *kwargs.values())
        groups = [v for v in values if isinstance(v, torch.ScriptObject)]  # c10d ops: the boxed group
        if groups:
            return self._axis_of(dist.ProcessGroup.unbox(groups[0]))
        names = [v for v in values if isinstance(v, str)]  # functional collectives: group name last
        if names:
            name = names[-1]
            return self.group_axes[name] if name in self.group_axes else self._axis_of(_resolve_process_group(name))
        return "unknown"

    def _axis_of(self, pg) -> str:
        """A group this counter was not told about is named by the mesh axis DeviceMesh created it
        for (its group_desc is "mesh_<axis>"), when that axis is one of ours: DTensor caches sharding
        by mesh equality, so a second trainer in one process may run collectives on an equal mesh an
        earlier one built (the tests run several per world), whose expert ep group has the ranks of
        dp_shard. Otherwise (FSDP2's replicate builds its own groups) by the axis whose group has the
        same ranks."""
        name = pg.group_name
        desc = getattr(pg, "group_desc", "")
        if name not in self.group_axes and desc.startswith("mesh_") and desc[5:] in self.group_axes.values():
            self.group_axes[name] = desc[5:]
        if name not in self.group_axes:
            ranks = dist.get_process_group_ranks(pg)
            known = {tuple(dist.get_process_group_ranks(_resolve_process_group(n))): axis
                     for n, axis in reversed(list(self.group_axes.items()))}
            self.group_axes[name] = known.get(tuple(ranks), name)
        return self.group_axes[name]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            # Let a tensor subclass (DTensor) run first; the collectives it issues on its local
            # tensors come back through this mode as plain-tensor ops and are counted then.
            return NotImplemented
        namespace = func.namespace
        name = func._schema.name.split("::")[-1]
        if namespace in ("_c10d_functional", "c10d_functional", "c10d") and name in _KINDS:
            self._count(name, args, kwargs)
        return func(*args, **kwargs)

    def _count(self, name: str, args, kwargs) -> None:
        kind = _KINDS[name]
        if name in _OUTPUT_FIRST:
            counted = _tensors(args[0])
        elif name in _INPUT_SECOND:
            counted = _tensors(args[1])
        elif name.startswith("all_gather_into_tensor"):
            # functional all-gather gets the shard and the group size: the output is size x input.
            counted = _tensors(args[0]) * int(args[1])
        else:
            counted = _tensors(args[0])
        axis = self._axis(args, kwargs)
        if axis == CONTROL_AXIS:
            return
        self.bytes[axis][kind] += _nbytes(counted)
        self.calls[axis][kind] += 1

    def totals(self) -> dict[str, dict[str, int]]:
        return {axis: dict(kinds) for axis, kinds in self.bytes.items()}


def describe_comm(totals: dict[str, dict[str, int]]) -> str:
    """'tp: all_gather 655.4 kB, reduce_scatter 655.4 kB; dp_shard: all_reduce 4 B' for the console."""
    return "; ".join(f"{axis}: " + ", ".join(f"{kind} {_bytes(n)}" for kind, n in sorted(kinds.items()))
                     for axis, kinds in sorted(totals.items()))


def _bytes(n: int) -> str:
    """Decimal units with one decimal, bytes as they are: a 4-byte loss all-reduce read "0.0 kB"."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
