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


def mesh_groups(mesh) -> dict[str, tuple[str, object]]:
    """{process-group name: (axis name, process group)} for every group the trainer's mesh (a Meshes or
    DeviceMesh) builds: its axes, the flattened batch, dp_cp and dp_shard_cp views, 2-D tensor
    parallelism's grid axes and the expert mesh's efsdp and ep axes. One walk, read by the byte counter
    (`axis_names`) and the per-axis collective clock (train/collective_wait.py), so both name a group
    alike. A group two of these share (a view that is one axis, parallel/mesh.py build_meshes) is named
    once: the axis wins over a view of it, dp_cp over dp_shard_cp."""
    found: list[tuple[str, object]] = []  # in order of precedence: a later entry renames the group
    if mesh is None:
        return {}
    root = getattr(mesh, "root", mesh)
    # Context parallel's flattened views, under the planner's names (plan/comm.py batch_axis, shard_axis).
    for view in (getattr(mesh, "dp_shard_cp", None), getattr(mesh, "dp_cp", None)):
        if view is not None:
            found.append((view.mesh_dim_names[0], view.get_group()))
    found += [(axis, root[axis].get_group()) for axis in root.mesh_dim_names or ()]
    batch = getattr(mesh, "batch", None)
    if batch is not None and batch.mesh_dim_names[0] not in root.mesh_dim_names:
        found.append(("dp", batch.get_group()))
    grid = getattr(mesh, "tp_grid", None)  # 2-D tensor parallelism (parallel/mesh.py build_tp_grid)
    if grid is not None:
        found += [(axis, grid[axis].get_group()) for axis in grid.mesh_dim_names]
    expert = getattr(mesh, "expert", None)  # parallel/expert.py builds its groups apart from the root's
    if expert is not None:
        found += [(axis, expert[axis].get_group()) for axis in ("efsdp", "ep") if axis in expert.mesh_dim_names]
    return {group.group_name: (axis, group) for axis, group in found}


def axis_names(mesh) -> dict[str, str]:
    """{process-group name: axis name} for every group of `mesh` (`mesh_groups`), plus the default
    (world) group. A 1-D mesh over the whole world may reuse the default group, which is then named by
    its axis."""
    names = {name: axis for name, (axis, _) in mesh_groups(mesh).items()}
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
