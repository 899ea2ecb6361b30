"""Apply every parallelism to a model built on the meta device, in one fixed order:

    PP split -> FP8 -> TP/SP -> CP -> EP -> linear tiles -> activation checkpointing -> compile -> FSDP
    (then init, then DDP)

Why this order: pipeline splitting decides which blocks a rank owns, so it comes first; TP/SP, CP and
EP rewrite modules inside a block and must see the plain modules; activation checkpointing wraps a
whole (already tensor-parallel) block so recomputation replays its collectives; compile sees the
final block; FSDP goes last because it shards whatever parameters (plain or DTensor) the earlier
steps produced. DDP needs materialized parameters, so it wraps after initialization.
CP (parallel/context.py) swaps every attention core for ring / Ulysses attention over the cp axis. EP
(parallel/expert.py) shards the stacked experts over the ep axis of its own (efsdp, ep) mesh before FSDP
sees them.
Linear tiles (parallel/tiling.py, parallel.linear_tiles > 1: ZeRO-Infinity's memory-centric tiling) swap
every dense MLP's forward for one that runs in tiles along the hidden dim and recomputes each tile in
backward. After TP / FP8 (it needs their plain nn.Linear weights; both are refused with tiling for now)
and before checkpointing, compile and FSDP, which then wrap, trace and shard the tiled MLP like any other:
its parameters keep their names, so FSDP units, checkpoints and init see the same model.

3-D (PP x data parallel x TP): the pp axis is outermost. Every local stage is a pruned copy of the
meta model (pipeline.py) and goes through `parallelize` on its own, so FSDP / replicate units end at
stage boundaries and the pipeline schedule drives their gradient reduction (once per step, after the
last micro-batch's backward).

2-D (TP x data parallel): one DeviceMesh with tp as its innermost axis, so the TP ranks of a group
are consecutive (one node on a GPU cluster: TP's per-layer collectives need NVLink bandwidth, while
FSDP/DDP traffic is per step and overlaps with compute). TP makes every parameter a DTensor on the
tp axis; FSDP then shards those DTensors again over dp_shard (FSDP2's 2-D support).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shardwise.config import Config
from shardwise.models.common import Transformer
from shardwise.models.feed_forward import fuse_training_projections
from shardwise.models.weights import WeightSource, weight_source
from shardwise.parallel.activation_checkpoint import apply_activation_checkpointing
from shardwise.parallel.compile import apply_compile, compile_enabled
from shardwise.parallel.context import apply_context_parallel
from shardwise.parallel.data_parallel import apply_ddp, apply_fsdp, apply_replicate
from shardwise.parallel.expert import apply_expert_parallel, moe_modules
from shardwise.parallel.float8 import apply_float8, check_fp8, fused_linear_for
from shardwise.parallel.precision import resolve_precision
from shardwise.parallel.tensor import align_gradients_with_parameters, apply_tensor_parallel
from shardwise.parallel.tensor2d import apply_tensor_parallel_2d
from shardwise.parallel.tiling import apply_linear_tiles
from shardwise.spec.dims import ParallelDims
from shardwise.spec.stages import layers_per_stage, stage_ids, stage_layers

# Module-name segments that wrappers insert; parameter identities (init seeds, checkpoint keys)
# use the model's own names, so every layout agrees on them.
_WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_orig_mod", "module")


def canonical_fqn(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def parallelize(model: Transformer, dims: ParallelDims, mesh, cfg: Config, device_type: str) -> None:
    """In place, on the meta model: everything that must happen before parameters exist."""
    # PP split: done by build_pipeline before this (each stage arrives here as its own model).
    wrapper = dims.wrapper(cfg.parallel.zero)
    if cfg.train.precision == "fp8":
        # First: the blocks' linears become torchao Float8Linears before TP, checkpointing, compile and
        # FSDP wrap them (parallel/float8.py); FSDP2 then gathers their weights in FP8 (tensorwise).
        check_fp8(device_type)
        apply_float8(model, cfg.train.fp8_recipe, fsdp=wrapper == "fsdp", emulate=device_type != "cuda",
                     head=cfg.train.fp8_head)
    if cfg.train.fuse_projections:
        # After FP8 (its linears take torchao's joined GEMM), before checkpointing, compile and FSDP wrap the
        # blocks; tp = 1 (spec/rules.py fused_projection_rules).
        fuse_training_projections(model, fused_linear_for)
    if dims.tp > 1 and dims.tp_mode == "2d":
        apply_tensor_parallel_2d(model, mesh.tp_grid)  # SUMMA on the q x q grid (parallel/tensor2d.py)
    elif dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], cfg.model, cfg.parallel.sequence_parallel)
    if dims.cp > 1:
        # After TP: the attention core then sees this rank's heads; before checkpointing, so a
        # recomputed block replays its ring / all-to-all traffic like the forward did.
        apply_context_parallel(model, mesh["cp"], cfg.parallel.cp_mode, cfg.train.seq_len)
        # A micro-batch's tokens are spread over the cp ranks: the MoE load-balancing statistics
        # (f, P, z) are summed over them, so the aux loss is the whole micro-batch's (models/moe.py).
        for moe in moe_modules(model):
            moe.stats_group = mesh["cp"].get_group()
    if dims.ep > 1:
        apply_expert_parallel(model, mesh.expert, dims, wrapper == "fsdp")
    if cfg.parallel.linear_tiles > 1:
        # After TP/CP/EP (the MLPs are final), before checkpointing / compile / FSDP wrap the blocks.
        apply_linear_tiles(model, cfg.parallel.linear_tiles)
    apply_activation_checkpointing(model, cfg.train.recompute, cfg.train.recompute_policy,
                                   cfg.train.recompute_every)
    if compile_enabled(cfg, device_type):
        # After checkpointing (the recomputed region is traced with the block); before FSDP, whose
        # hooks then run around the compiled block, outside the graph (parallel/compile.py).
        apply_compile(model, cfg.train.compile_backend)
    if wrapper == "fsdp":
        apply_fsdp(model, mesh, dims, cfg.parallel, cfg.train.precision)
    elif wrapper == "replicate":
        apply_replicate(model, mesh, cfg.train.precision, cfg.parallel.grad_compression)
    # "ddp" wraps after materialize (build_parallel_model); "none" needs nothing.


def state_devices(dims: ParallelDims, device: torch.device) -> tuple[torch.device, torch.device]:
    """Where materialize puts (parameters, buffers) for a run on `device`.

    With offload (parallel.offload "cpu" / "nvme") FSDP2's CPUOffloadPolicy owns the parameters' home:
    the sharded parameters must be materialised on the CPU (FSDP2 copies each unit to the device for its
    forward and backward, and refuses a CUDA parameter at its first forward: "FSDP parameters should be
    materialized on CPU when enabling CPU offloading"), while buffers (the RoPE tables), which FSDP does
    not manage, live where the forward runs. On a CPU device both are the CPU, which is why only a GPU
    showed it; the decision is tested for a CUDA device on CPU (tests/unit/test_offload.py)."""
    if dims.offload:
        return torch.device("cpu"), device
    return device, device


@torch.no_grad()
def materialize(model: Transformer, device: torch.device, source: WeightSource | None,
                buffer_device: torch.device | None = None) -> None:
    """Allocate the (possibly sharded) parameters on `device`, the buffers on `buffer_device` (default:
    `device`; state_devices says which), and give them layout-independent values.

    Each parameter's *global* value comes from `source` (models/weights.py: the name-seeded random init,
    or a Hugging Face checkpoint); a sharded parameter (DTensor) asks only for its slice. No random
    number is ever drawn per shard (docs/architecture.md §3), so every layout starts from the same
    weights as the single-device reference. `source=None` only allocates: the caller loads every value
    (a checkpoint, infer/engine.py).
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    model.to_empty(device=device)
    if buffer_device is not None and buffer_device != device:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module.register_buffer(name, torch.empty_like(buffer, device=buffer_device),
                                       persistent=name not in module._non_persistent_buffers_set)
    for name, param in model.named_parameters() if source is not None else ():
        fqn = canonical_fqn(name)
        if isinstance(param, DTensor):
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
            param.to_local().copy_(source.value(fqn, param.shape, index))
        else:
            param.copy_(source.value(fqn, param.shape, None))
    model.reset_buffers()


def _finish(model: nn.Module, dims: ParallelDims, cfg: Config) -> None:
    if dims.tp > 1 and dims.wrapper(cfg.parallel.zero) not in ("fsdp", "replicate"):
        # FSDP2 and its replicate align DTensor gradients in their own post-backward; the rest need the hook.
        # After materialize: moving the parameters off the meta device drops hooks on them.
        align_gradients_with_parameters(model)


def build_parallel_model(model: Transformer, dims: ParallelDims, mesh, cfg: Config,
                         device: torch.device, on_meta: bool = False) -> nn.Module:
    """parallelize -> materialize -> DDP wrap; returns the module the trainer calls. `on_meta=True` stops
    after parallelize: the rank's modules with their (DTensor) shapes on the meta device, nothing
    allocated — `shardwise dryrun` (launch/dryrun.py) builds a rank of a large job that way; DDP wraps
    only materialized parameters, and its buckets hold the same gradient bytes, so it is left out."""
    # train.precision unset: decided for the device (the Trainer has done so already; other callers may not).
    cfg = resolve_precision(cfg, device)
    parallelize(model, dims, mesh, cfg, device.type)
    if on_meta:
        return model
    params_on, buffers_on = state_devices(dims, device)
    materialize(model, params_on, weight_source(model, cfg.model.init_from, cfg.train.seed), buffers_on)
    _finish(model, dims, cfg)
    if dims.wrapper(cfg.parallel.zero) == "ddp":
        return apply_ddp(model, mesh, dims, cfg.parallel)
    return model


@dataclass
class PipelineParts:
    """This rank's pipeline stages (stage index -> parallelized module) and `model`, one module over
    all of them with whole-model parameter names (optimizer, checkpoints, memory accounting)."""

    stages: dict[int, nn.Module]
    model: nn.Module
    layers: list[list[int]]  # blocks of every stage, stage order


def build_pipeline(dims: ParallelDims, mesh, cfg: Config, device: torch.device, pp_rank: int,
                   on_meta: bool = False) -> PipelineParts:
    """This pipeline rank's stages, each split, parallelized and materialized; `on_meta=True` leaves them on the
    meta device unmaterialized (`shardwise dryrun`: see build_parallel_model)."""
    from shardwise.models import ARCHS, build_model

    p = cfg.parallel
    costs = ARCHS[cfg.model.arch].pipeline_costs(cfg.model, cfg.train.seq_len)  # closed form: no model built
    layers = stage_layers(layers_per_stage(p, cfg.model, cfg.train.seq_len, costs))
    last = len(layers) - 1
    stages: dict[int, nn.Module] = {}
    for stage in stage_ids(p.pp_schedule, p.pp, p.pp_virtual_stages, pp_rank):
        with torch.device("meta"):
            part = build_model(cfg.model)
        part.keep_only(layers[stage], embedding=stage == 0, head=stage == last)
        parallelize(part, dims, mesh, cfg, device.type)
        if not on_meta:
            params_on, buffers_on = state_devices(dims, device)
            materialize(part, params_on, weight_source(part, cfg.model.init_from, cfg.train.seed), buffers_on)
            _finish(part, dims, cfg)
        stages[stage] = part
    model = stages[min(stages)] if len(stages) == 1 else _union(stages, cfg)
    return PipelineParts(stages, model, layers)


def _union(stages: dict[int, nn.Module], cfg: Config) -> nn.Module:
    """One module holding the submodules of several stages under their whole-model names (built on
    meta and filled with the stages' own submodules, so no parameter is copied)."""
    from shardwise.models import build_model

    with torch.device("meta"):
        union = build_model(cfg.model)
    ids = sorted(int(name) for part in stages.values() for name, _ in part.named_blocks())
    union.keep_only(ids, embedding=False, head=False)
    for part in stages.values():
        for name, block in part.layers.named_children():
            setattr(union.layers, name, block)
        for name, child in part.named_children():  # embeddings, head, buffers-only modules (RoPE)
            if name != "layers":
                setattr(union, name, child)
    return union
