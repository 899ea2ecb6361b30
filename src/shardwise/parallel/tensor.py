"""Tensor parallelism (Megatron-style 1-D TP, Shoeybi et al. 2019, arXiv 1909.08053) with sequence
parallelism (Korthikanti et al. 2022, arXiv 2205.05198 §4.2) and loss parallelism, on DTensor.

The plan is data: `tp_plan(cfg)` maps module names (a `*` stands for every block index) to split
kinds (spec/shapes.py), so it can be printed and tested without a process group;
`apply_tensor_parallel` turns it into DTensor `ParallelStyle`s and calls `parallelize_module`.

Layout per block (h = hidden, s = sequence, tp = TP size):
  attention: wq / wk / wv column-wise (split by heads), wo row-wise;
  MLP: up / gate (w1, w3; gpt: fc) column-wise, down (w2; gpt: proj) row-wise;
  MoE feed-forward: one region (MoERegion): router replicated, every expert and the shared experts
  split on the ffn dim (Megatron expert-TP), the partial outputs reduced once at the exit.
Without SP the block input is replicated and each row-wise output is all-reduced (Megatron's g);
the column-wise input's gradient is all-reduced in backward (Megatron's f): 2 all-reduces of s·h per
block forward and 2 in backward. With SP the norms run on s/tp tokens; the replicated input of a
TP region is all-gathered and the row-wise output reduce-scattered along the sequence instead —
the same bytes on the wire, but activations outside the TP regions shrink by tp.

Vocabulary: the embedding is split by rows (vocab-parallel; the partial sums are reduced like a
row-wise output) and the output head by columns, so the logits stay sharded on the vocab dim and
`loss_parallel` computes cross-entropy without gathering them. A vocabulary that tp does not divide
is sharded unevenly by DTensor (shard sizes ceil(V/tp) .. and a shorter last one): no padding rows
exist in the parameters, so the padding Megatron adds (and its effect on the loss) cannot occur.
"""
from __future__ import annotations

import fnmatch

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from shardwise.config import ModelConfig
from shardwise.spec.shapes import (
    COLWISE,
    COLWISE_REPLICATED_KV,
    MOE_REGION,
    NORM,
    POSITION_EMBEDDING,
    REGION_INPUT,
    ROWWISE,
    VOCAB_EMBEDDING,
    VOCAB_HEAD,
    ModelShape,
)


def tp_plan(model: ModelConfig, tp: int) -> dict[str, str]:
    """{module fqn pattern: kind} for `model` (before any wrapper is applied): spec/shapes.py's one
    description of the architecture, from which the planner sizes the same split."""
    return ModelShape.from_config(model).tp_modules(tp)


def expand_plan(plan: dict[str, str], module: nn.Module) -> dict[str, str]:
    """Resolve `*` patterns against the module tree; every pattern must match something."""
    names = [n for n, _ in module.named_modules() if n]
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern) and n.count(".") == pattern.count(".")]
        if not hits:
            raise ValueError(f"TP plan entry {pattern!r} matches no module")
        resolved.update({n: style for n in hits})
    return resolved


def apply_tensor_parallel(model: nn.Module, tp_mesh, cfg: ModelConfig, sequence_parallel: bool) -> None:
    """Parallelize `model` in place over the 1-D `tp_mesh`; every parameter becomes a DTensor on it."""
    # A pipeline stage lacks some top-level parts (embedding, head): their entries do not apply.
    blocks = {name for name, _ in model.layers.named_children()}
    present = {k: v for k, v in tp_plan(cfg, tp_mesh.size()).items() if getattr(model, k.split(".")[0], None) is not None
               and (not k.startswith("layers.") or k.split(".")[1] in ("*", *blocks))}
    plan = expand_plan(present, model)
    styles = _styles(sequence_parallel, cfg, tp_mesh.size())
    parallelize_module(model, tp_mesh, {name: styles[style] for name, style in plan.items()})
    # Modules the plan does not name still hold plain parameters; make them replicated DTensors so
    # every parameter lives on the mesh (uniform grad clipping, FSDP 2-D and checkpoints).
    _replicate_remaining(model, tp_mesh)


def align_gradients_with_parameters(model: nn.Module) -> None:
    """Give every DTensor parameter's gradient the parameter's own placement as it is accumulated.

    DTensor leaves two kinds of gradients in another layout than their parameter: a replicated
    weight used on sequence-sharded (SP norms) or rank-sliced (replicated KV heads) activations gets
    a Partial gradient, and the vocab-parallel embedding's backward produces a *full* replicated
    (V, h) gradient. Left alone, the optimizer would redistribute the Partial ones inside every
    foreach op (several all-reduces per step) and the embedding would keep a V x h gradient per
    rank. One redistribute per accumulation fixes both: an all-reduce of the small Partial ones, a
    local slice of the embedding's. FSDP2 (and its replicate) does the same in its own
    post-backward, so this is for layouts without them."""
    for param in model.parameters():
        if isinstance(param, DTensor) and param.requires_grad:
            param.register_post_accumulate_grad_hook(_align_grad)


def _align_grad(param: DTensor) -> None:
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def _styles(sp: bool, cfg: ModelConfig, tp: int) -> dict[str, ParallelStyle]:
    # Activations between TP regions: sharded along the sequence (dim 1) with SP, else replicated.
    between = Shard(1) if sp else Replicate()
    return {
        COLWISE: ColwiseParallel(),
        ROWWISE: RowwiseParallel(output_layouts=between),
        VOCAB_EMBEDDING: RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        # Logits stay vocab-sharded DTensors for loss_parallel.
        VOCAB_HEAD: ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
        NORM: SequenceParallel(use_local_output=True) if sp else ReplicateParallel(),
        REGION_INPUT: RegionInput(between),
        COLWISE_REPLICATED_KV: ReplicatedKVColwise(cfg.n_kv_heads, tp),
        POSITION_EMBEDDING: ReplicateParallel(output_layout=Shard(0) if sp else None),
        MOE_REGION: MoERegion(between),
    }


def _replicate_remaining(model: nn.Module, mesh: DeviceMesh) -> None:
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                module.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh, [Replicate()]),
                                                             requires_grad=param.requires_grad))


def _as_replicated(x, mesh: DeviceMesh):
    if isinstance(x, DTensor):
        return x.redistribute(mesh, [Replicate()])
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False)


class RegionInput(ParallelStyle):
    """Entry of a TP region (attention, MLP): the block's activation (sequence-sharded with SP, else
    replicated) becomes one replicated DTensor shared by all the column-wise projections inside.
    Sharing it means their input gradients add up as one Partial and are reduced once at this
    boundary (Megatron's f: one all-reduce, or one reduce-scatter with SP), not once per projection."""

    def __init__(self, layout: Placement):
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def to_replicated(_mod, inputs):
            x = DTensor.from_local(inputs[0], mesh, [self.layout], run_check=False)
            return (x.redistribute(mesh, [Replicate()]), *inputs[1:])

        # A hook, not distribute_module: that would replicate the parameters of the projections
        # inside, which their own styles shard.
        module.register_forward_pre_hook(to_replicated)
        return module


class ReplicateParallel(ParallelStyle):
    """Replicated parameters on a module whose input is replicated (a norm without SP, gpt's learned
    position table). With `output_layout=Shard(0)` the (s, h) output is cut along the sequence for
    SP; its gradient is all-gathered back, so every rank's replicated table gets the full gradient."""

    def __init__(self, output_layout: Placement | None = None):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def input_fn(_mod, inputs, device_mesh):
            return tuple(_as_replicated(x, device_mesh) if isinstance(x, torch.Tensor) else x for x in inputs)

        def output_fn(_mod, out, device_mesh):
            if self.output_layout is not None:
                out = out.redistribute(device_mesh, [self.output_layout])
            return out.to_local()

        return distribute_module(module, mesh, None, input_fn=input_fn, output_fn=output_fn)


class ReplicatedKVColwise(ParallelStyle):
    """Key/value projection when there are fewer KV heads than TP ranks (GQA with n_kv < tp).

    Every rank keeps the whole (small) projection as a replicated DTensor but computes only the KV
    head its query heads attend with: rank r owns query heads [r·a/tp, (r+1)·a/tp), which all use
    KV head r·n_kv/tp (Megatron copies that head to each such rank). The product is taken on local
    tensors, so nothing is communicated in forward; each rank's weight gradient covers only its own
    head's rows and its input gradient only its own contribution, so both are marked Partial: the
    weight's is all-reduced once per micro-batch (align_gradients_with_parameters, or FSDP2), the
    input's joins the other projections' Partial gradient at the region entry.
    """

    def __init__(self, n_kv_heads: int, tp: int):
        super().__init__()
        self.n_kv_heads, self.ranks_per_head = n_kv_heads, tp // n_kv_heads

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        distribute_module(module, mesh, None)  # weight (and bias) become replicated DTensors
        head = mesh.get_local_rank() // self.ranks_per_head
        rows = slice(head * module.out_features // self.n_kv_heads, (head + 1) * module.out_features // self.n_kv_heads)

        def forward(x: torch.Tensor) -> torch.Tensor:
            if isinstance(x, DTensor):
                x = x.to_local(grad_placements=[Partial()])
            weight = module.weight.to_local(grad_placements=[Partial()])[rows]
            bias = None if module.bias is None else module.bias.to_local(grad_placements=[Partial()])[rows]
            return torch.nn.functional.linear(x, weight, bias)

        module.forward = forward
        return module


class MoERegion(ParallelStyle):
    """A MoE feed-forward block as one TP region (Megatron-style expert tensor parallelism: every tp
    rank holds all experts, each split on the ffn dim like a dense MLP).

    Entry as RegionInput: the block's activation (sequence-sharded with SP, else replicated) becomes
    the full micro-batch's tokens on every tp rank, so routing (router replicated, fp32 logits,
    top-k, capacity over the same T tokens) is identical on all tp ranks and equals one process's.
    Stacked experts w1 / w3 / fc (E, f, h) are Shard(1) over tp, w2 / proj (E, h, f) Shard(2); the
    shared experts are split column- / row-wise like the dense MLP. Everything inside runs on local
    tensors (data-dependent routing has no DTensor sharding rules) and yields this rank's *partial*
    output (its ffn slice, routed plus shared), summed over tp once at the exit: an all-reduce, or
    with SP a reduce-scatter along the sequence, like RowwiseParallel — the same collectives as a
    dense MLP region (plan/comm.py counts them so).

    Gradients. The experts' (and shared experts') local gradients are exactly their slices'. The
    router is replicated but its gradient is *not* the same on every tp rank: the combine weights
    multiply this rank's partial expert outputs, so their gradient (and through them the router's
    and the input's) is this rank's partial share. Hence the router weight and the region input
    enter with `grad_placements=[Partial()]` (like ReplicatedKVColwise): the router's gradient is
    all-reduced over tp once per gradient sync (align_gradients_with_parameters, or FSDP2), the
    input's joins the region-entry reduction (one all-reduce / reduce-scatter, as for the dense MLP).
    The aux / z losses are computed identically on every tp rank; for their gradient to be counted
    once in that sum each rank injects 1 / tp of it (MoE.aux_grad_share). A Replicate router gradient
    would need the combine-weight gradients all-reduced per MoE layer and micro-batch instead."""

    def __init__(self, layout: Placement):
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        tp, rank = mesh.size(), mesh.get_local_rank()

        def shard(owner: nn.Module, name: str, placement: Placement) -> None:
            param = getattr(owner, name)
            # src_data_rank=None: no communication; the values come from materialize's global init.
            dt = distribute_tensor(param.data, mesh, [placement], src_data_rank=None)
            owner.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))

        shard(module.router, "weight", Replicate())
        for name, _ in list(module.experts.named_parameters(recurse=False)):
            shard(module.experts, name, Shard(2 if name in ("w2", "proj") else 1))
        shared = module.shared_experts
        if shared is not None:
            cols, row = ((shared.w1, shared.w3), shared.w2) if hasattr(shared, "w1") else ((shared.fc,), shared.proj)
            for lin in cols:
                shard(lin, "weight", Shard(0))
                if lin.bias is not None:
                    shard(lin, "bias", Shard(0))
            shard(row, "weight", Shard(1))
            if row.bias is not None:
                shard(row, "bias", Replicate())

            def shared_forward(x: torch.Tensor) -> torch.Tensor:
                def col(lin):
                    bias = None if lin.bias is None else lin.bias.to_local()
                    return torch.nn.functional.linear(x, lin.weight.to_local(), bias)

                if hasattr(shared, "w1"):
                    h = torch.nn.functional.silu(col(shared.w1)) * col(shared.w3)
                else:
                    h = torch.nn.functional.gelu(col(shared.fc), approximate="tanh")
                out = torch.nn.functional.linear(h, row.weight.to_local())
                if row.bias is not None:
                    # Added once to the tp sum: by rank 0 (the others add 0, so every rank's bias
                    # has a gradient: rank 0's is the full one, a Partial sum).
                    bias = row.bias.to_local(grad_placements=[Partial()])
                    out = out + (bias if rank == 0 else bias * 0.0)
                return out

            module.shared_forward = shared_forward
        module.router_weight = lambda: module.router.weight.to_local(grad_placements=[Partial()])
        module.aux_grad_share = 1.0 / tp
        inner = module.forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            full = DTensor.from_local(x, mesh, [self.layout], run_check=False).redistribute(mesh, [Replicate()])
            partial = inner(full.to_local(grad_placements=[Partial()]))
            out = DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(mesh, [self.layout])
            return out.to_local()

        module.forward = forward
        return module
