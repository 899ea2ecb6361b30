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

from shardwise.parallel.tiling import tiles_running

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


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # A tiled MLP's GEMMs (parallel/tiling.py) are recomputed by its own backward, tile by tile: caching
    # them here would keep the ffn-wide tensors tiling drops.
    if op in SELECTIVE_SAVE_OPS and not tiles_running():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_op_context():
    return create_selective_checkpoint_contexts(_save_matmuls)


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
                                         context_fn=partial(selective_op_context))
        else:
            continue
        setattr(model.layers, name, wrapped)
