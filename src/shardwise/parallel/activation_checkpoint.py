"""Activation checkpointing (recomputation) of transformer blocks.

full: every block recomputes its forward in backward (activations kept: the block inputs only).
selective "layer": every k-th block is checkpointed. selective "op": inside every block, outputs of
matmuls, attention and TP reductions are saved and cheap pointwise ops are recomputed, the spirit of Korthikanti et
al. 2022 (arXiv 2205.05198 §4) selective recomputation.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from shardwise.parallel.tiling import TiledGELUMLP, TiledSwiGLU, TileScope

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


def _save_matmuls(scope: TileScope | None, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # A tiled MLP's GEMMs (parallel/tiling.py) are recomputed by its own backward, tile by tile: caching
    # them here would keep the ffn-wide tensors tiling drops (`scope`: the block's tiled MLP is running).
    if op in SELECTIVE_SAVE_OPS and not (scope is not None and scope.active):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_op_context(scope: TileScope | None = None):
    return create_selective_checkpoint_contexts(partial(_save_matmuls, scope))


def _tile_scope(block: nn.Module) -> TileScope | None:
    """A TileScope shared by `block`'s tiled MLPs and its checkpoint policy, or None without tiles."""
    tiled = [m for m in block.modules() if isinstance(m, (TiledSwiGLU, TiledGELUMLP))]
    if not tiled:
        return None
    scope = TileScope()
    for module in tiled:
        module.tile_scope = scope
    return scope


def apply_activation_checkpointing(model: nn.Module, mode: str, policy: str, every: int) -> None:
    """Wrap the blocks of `model` in place according to train.recompute / recompute_policy / every.
    `every` counts global block indices, so a pipeline stage wraps the blocks the whole model would."""
    if mode == "none":
        return
    for name, block in model.named_blocks():
        if mode == "full" or (policy == "layer" and int(name) % every == 0):
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        elif policy == "op":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False,
                                         context_fn=partial(selective_op_context, _tile_scope(block)))
        else:
            continue
        setattr(model.layers, name, wrapped)
