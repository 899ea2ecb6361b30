"""Expert parallelism (EP): the experts of every MoE block are split over `ep` ranks, tokens travel to
their experts and back with two all-to-alls per layer (GShard, Lepikhin et al. 2020, arXiv 2006.16668;
torchtitan's layout).

Expert mesh. Experts live on the dp_shard x cp ranks (ParallelDims requires ep | dp_shard * cp): that
block of the root mesh, reshaped row-major into (efsdp, ep), gives each rank an ep group (the innermost
ep ranks: consecutive, one node on a GPU cluster, as plan/layout.py axis_placement assumes) and an efsdp
group (the ranks holding the same experts). The mesh is its own DeviceMesh over the whole world with
axes ("pp", "dp_replicate", "efsdp", "ep", "tp") (size-1 axes dropped) and ranks in the root mesh's
row-major order, so the ep view and the efsdp view come from one root, as FSDP2's 2-D sharding of a
DTensor parameter requires.

Parameters. Stacked expert weights (E, out, in) become DTensors Shard(0) over ep: each rank holds E/ep
experts, and DCP checkpoints key them by their global shape (resharding works). When efsdp > 1 the
experts module is its own FSDP2 unit over efsdp (torchtitan); otherwise FSDP ignores the expert
parameters (no rank holds a copy of them to reduce with). Gradient scale: one expert's gradient sums
the contributions of the tokens of the whole ep group, each scaled like its rank's loss (token sum /
tokens per rank); the dense parameters' gradients are *averaged* over all dp_shard x cp data ranks, so
the experts' must be divided by the same dp_shard x cp: FSDP's reduce-scatter over efsdp divides by
that factor (`set_gradient_divide_factor`), and without FSDP a gradient hook on the local weights does.

Dispatch (`ExpertParallelExperts.forward`): the router output arrives sorted by expert with its
per-expert counts; the counts are exchanged first (all_to_all of E int64), then the token copies go
out with `all_to_all_single_autograd` (uneven splits), are re-sorted by local expert, computed expert
by expert, put back into source-rank order and returned by the reverse all-to-all (combine).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from shardwise.models.moe import GroupedExperts, MoE
from shardwise.spec.dims import ParallelDims
from shardwise.tensors import local_shard


def moe_modules(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    return {p for m in moe_modules(model) for p in m.experts.parameters()}


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` (per use, so accumulation and
    recomputation stay exact)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class ExpertParallelExperts(GroupedExperts):
    """GroupedExperts whose weights hold this rank's E/ep experts (DTensor Shard(0) over ep)."""

    ep_group: dist.ProcessGroup
    ep: int
    grad_scale: float

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        ep, group = self.ep, self.ep_group
        local_e = counts.numel() // ep
        # recv[r * local_e + e]: copies rank r sends to my local expert e.
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts.contiguous(), group=group)
        send_splits = counts.view(ep, local_e).sum(1).tolist()
        recv_counts = recv.view(ep, local_e)
        recv_splits = recv_counts.sum(1).tolist()
        routed = all_to_all_single_autograd(x.contiguous(), recv_splits, send_splits, group)
        # Source-rank-major -> local-expert-major (and back after the experts).
        sizes = recv_counts.reshape(-1).tolist()
        segments = torch.split(routed, sizes)
        by_expert = torch.cat([segments[r * local_e + e] for e in range(local_e) for r in range(ep)])
        weights = []
        for w in self.weights():
            local = local_shard(w)
            if self.grad_scale != 1.0:
                local = _ScaleGrad.apply(local, self.grad_scale)
            weights.append(local.to(x.dtype))
        y = self.compute(by_expert, recv_counts.sum(0).tolist(), weights)
        y_segments = torch.split(y, [sizes[r * local_e + e] for e in range(local_e) for r in range(ep)])
        back = torch.cat([y_segments[e * ep + r] for r in range(ep) for e in range(local_e)])
        return all_to_all_single_autograd(back, send_splits, recv_splits, group)


def apply_expert_parallel(model: nn.Module, expert_mesh, dims: ParallelDims, fsdp: bool) -> None:
    """On the meta model: shard every MoE block's experts over ep and switch them to the all-to-all
    forward. `fsdp`: the data-parallel mode is FSDP (the only one EP composes with, see preflight),
    which then reduces expert gradients over efsdp when efsdp > 1."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    ep_mesh = expert_mesh["ep"]
    efsdp = dims.shard_group // dims.ep
    data_ranks = dims.dp_shard * dims.cp  # dp_replicate > 1 is refused with ep (preflight)
    for moe in moe_modules(model):
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            # src_data_rank=None: no communication, each rank keeps its slice (values come later
            # from materialize's layout-independent init).
            if isinstance(param, DTensor):
                # Already split on the ffn dim over tp (parallel/tensor.py MoERegion): a 2-D DTensor
                # on the expert mesh's (ep, tp) axes, experts over ep and the same ffn split over tp
                # (FSDP2 shards such "EP+TP" parameters over efsdp). The expert mesh's tp groups hold
                # the same ranks as the root mesh's; nothing is communicated on them in the MoE
                # forward (each rank computes on its local slices).
                full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
                dt = distribute_tensor(full, expert_mesh["ep", "tp"], [Shard(0), *param.placements], src_data_rank=None)
            else:
                dt = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
        experts.__class__ = ExpertParallelExperts
        experts.ep_group, experts.ep = ep_mesh.get_group(), dims.ep
        # With FSDP over efsdp the reduce-scatter divides instead (set in shard_experts).
        experts.grad_scale = 1.0 if (fsdp and efsdp > 1) else 1.0 / data_ranks


def expert_placement(param: nn.Parameter, shards: int):
    """Where FSDP2 cuts a stacked expert weight (local experts, out, in) over `shards` ranks: on dim 0 (whole
    experts) when each rank gets at least one, else on dim 1 where it divides evenly (FSDP2 pads dim 0 only;
    torchtitan's rule). Dim 0 with fewer experts than shards pads every rank to a whole expert: Mixtral 8x7B
    at tp8 x dp_shard128 x ep8 kept 2.63 GiB of expert parameters a rank instead of 0.17 (found by
    `shardwise dryrun`, issue 58). plan/inventory.py fsdp_shard_numel prices the same rule.
    The rule reads the rank's own tensor: under EP the weight is a DTensor over ep (and tp) whose `shape` is
    the global one, all experts, and FSDP2 cuts its local tensor; the global count padded tiny-moe's 2 local
    experts a rank over efsdp 4 into whole experts (8 experts, ep 4, dp_shard 8 x cp 2: 49,152 bytes of
    parameters a rank above the plan, found by the dry run's expert-group ranks)."""
    from torch.distributed.tensor import DTensor, Shard

    local = param.to_local() if isinstance(param, DTensor) else param
    return Shard(1) if local.ndim == 3 and local.shape[0] < shards and local.shape[1] % shards == 0 else Shard(0)


def shard_experts(model: nn.Module, expert_mesh, dims: ParallelDims, reshard: bool, fsdp_kwargs: dict) -> set[nn.Parameter]:
    """Before the dense FSDP units: each experts module becomes an FSDP2 unit over efsdp (when > 1)
    with the gradient divided by every data rank (dp_shard x cp), not only efsdp. Returns the expert
    parameters the dense units must ignore when efsdp == 1."""
    from torch.distributed.fsdp import fully_shard

    if expert_mesh is None:
        return set()
    efsdp = dims.shard_group // dims.ep
    if efsdp == 1:
        return expert_parameters(model)
    for moe in moe_modules(model):
        fully_shard(moe.experts, mesh=expert_mesh["efsdp"], reshard_after_forward=reshard,
                    shard_placement_fn=functools.partial(expert_placement, shards=efsdp),
                    **{k: v for k, v in fsdp_kwargs.items() if k != "mesh"})
        moe.experts.set_gradient_divide_factor(float(dims.dp_shard * dims.cp))
        # A custom factor would use ReduceOp.PREMUL_SUM, which gloo lacks: sum, then divide.
        moe.experts.set_force_sum_reduction_for_comms(True)
    return set()
