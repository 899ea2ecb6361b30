"""Activation checkpointing (recomputation) of transformer blocks.

full: every block recomputes its forward in backward (activations kept: the block inputs only).
selective "layer": every k-th block is checkpointed. selective "op": inside every block, outputs of
matmuls, attention and TP reductions are saved and cheap pointwise ops are recomputed, the spirit of Korthikanti et
al. 2022 (arXiv 2205.05198 §4) selective recomputation. selective "op_alternate": as "op", but of the matmuls
"op" would keep, only the 1st, 3rd, 5th, ... of each block's forward are (torchtitan's per-op policy): a llama
block recomputes wk, wo and w3 (compiled, only wk and w3: nothing reads wo's output in backward), less memory
for a third more forward GEMM work.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from shardwise.parallel.tiling import TiledGELUMLP, TiledSwiGLU, UncachedRegion
from shardwise.spec.layout import PER_OP_POLICIES

# Ops whose outputs are expensive to recompute (GEMMs, attention): saved under selective "op".
SELECTIVE_SAVE_OPS = frozenset({
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    # TP collectives whose outputs are block-sized: saving them means recomputation does not talk
    # again. The SP all-gather is left out: its output is the full-sequence activation, tp times
    # the sharded one, and re-gathering it is what Korthikanti et al. §5 accept for that memory.
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
})


def keeps(op, scope: UncachedRegions | None, matmuls: AlternateMatmuls | None = None) -> bool:
    """Whether a block's selective checkpoint keeps `op`'s output: one of SELECTIVE_SAVE_OPS outside the block's
    uncached regions and, under "op_alternate" (`matmuls`: the block's count), not a 2nd, 4th, ... matmul.
    The policy decides by it, and the memory meter (train/memory_meter.py) counts by it."""
    # A tiled MLP's GEMMs (parallel/tiling.py) are recomputed by its own backward, tile by tile, and ring
    # attention's by the replay: caching them here would keep the ffn-wide tensors tiling drops, or a score
    # matrix per pair of sequence chunks (`scope`: one of the block's uncached regions is running).
    kept = op in SELECTIVE_SAVE_OPS and not (scope is not None and scope.active)
    return kept if matmuls is None else matmuls.keeps(op, kept)


def _save_matmuls(scope: UncachedRegions | None, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if keeps(op, scope) else CheckpointPolicy.PREFER_RECOMPUTE


# The matmuls "op_alternate" counts: a linear's GEMM (addmm with a bias). FP8 linears reach the policy as
# aten.mm too (torchao's Float8 tensors dispatch it before their own _scaled_mm).
MATMUL_OPS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})


class AlternateMatmuls:
    """One forward of a block under "op_alternate": keeps what "op" keeps except the 2nd, 4th, ... matmul.
    torch 2.13 asks the policy in the forward only and replays its decisions; a torch that asks again in
    the replay gets a count of its own, from one, so both decide alike."""

    def __init__(self):
        self.matmuls = 0

    def keeps(self, op, kept_by_op: bool) -> bool:
        if not kept_by_op or op not in MATMUL_OPS:
            return kept_by_op
        self.matmuls += 1
        return self.matmuls % 2 == 1


def _save_alternate_matmuls(counts: dict[bool, AlternateMatmuls], scope: UncachedRegions | None, ctx, op, *args,
                            **kwargs) -> CheckpointPolicy:
    kept = _save_matmuls(scope, ctx, op, *args, **kwargs) == CheckpointPolicy.MUST_SAVE  # what "op" keeps
    return CheckpointPolicy.MUST_SAVE if counts[ctx.is_recompute].keeps(op, kept) else CheckpointPolicy.PREFER_RECOMPUTE


def selective_op_context(scope: UncachedRegions | None = None):
    return create_selective_checkpoint_contexts(partial(_save_matmuls, scope))


def selective_alternate_context(scope: UncachedRegions | None = None):
    """Called by the checkpoint at each forward of its block: fresh counts for that forward and its replay."""
    counts = {False: AlternateMatmuls(), True: AlternateMatmuls()}
    return create_selective_checkpoint_contexts(partial(_save_alternate_matmuls, counts, scope))


class UncachedRegions:
    """The regions of one block its checkpoint policy does not cache (tiling.UncachedRegion): its tiled MLPs'
    (one region per block) and its attention core's when that is ring attention (one region per ring)."""

    def __init__(self, regions: list[UncachedRegion]):
        self.regions = regions

    @property
    def active(self) -> bool:
        return any(region.active for region in self.regions)


def _uncached_regions(block: nn.Module) -> UncachedRegions | None:
    """`block`'s uncached regions, its tiled MLPs given one of their own here, or None without any."""
    tiled = [m for m in block.modules() if isinstance(m, (TiledSwiGLU, TiledGELUMLP))]
    if tiled:
        region = UncachedRegion()
        for module in tiled:
            module.tile_scope = region
    regions = uncached_regions_of([block])
    return UncachedRegions(regions) if regions else None


def uncached_regions_of(blocks) -> list[UncachedRegion]:
    """Every uncached region `blocks` hold (a tiled MLP's `tile_scope`, a ring attention core's `uncached`), each
    once; for the memory meter too (train/memory_meter.py), which counts what the policy caches."""
    found: dict[int, UncachedRegion] = {}
    for block in blocks:
        for module in block.modules():
            for region in (getattr(module, "tile_scope", None), getattr(getattr(module, "core", None), "uncached", None)):
                if isinstance(region, UncachedRegion):
                    found[id(region)] = region
    return list(found.values())


def apply_activation_checkpointing(model: nn.Module, mode: str, policy: str, every: int) -> None:
    """Wrap the blocks of `model` in place according to train.recompute / recompute_policy / every.
    `every` counts global block indices, so a pipeline stage wraps the blocks the whole model would."""
    if mode == "none":
        return
    for name, block in model.named_blocks():
        if mode == "full" or (policy == "layer" and int(name) % every == 0):
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        elif policy in PER_OP_POLICIES:
            context = selective_op_context if policy == "op" else selective_alternate_context
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=partial(context, _uncached_regions(block)))
        else:
            continue
        setattr(model.layers, name, wrapped)
