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


def _save_alternate_matmuls(counts: dict[bool, AlternateMatmuls], scope: TileScope | None, ctx, op, *args,
                            **kwargs) -> CheckpointPolicy:
    kept = _save_matmuls(scope, ctx, op, *args, **kwargs) == CheckpointPolicy.MUST_SAVE
    keep = counts[ctx.is_recompute].keeps(op, kept)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def selective_op_context(scope: TileScope | None = None):
    return create_selective_checkpoint_contexts(partial(_save_matmuls, scope))


def selective_alternate_context(scope: TileScope | None = None):
    """Called by the checkpoint at each forward of its block: fresh counts for that forward and its replay."""
    counts = {False: AlternateMatmuls(), True: AlternateMatmuls()}
    return create_selective_checkpoint_contexts(partial(_save_alternate_matmuls, counts, scope))


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
        elif policy in ("op", "op_alternate"):
            context = selective_op_context if policy == "op" else selective_alternate_context
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=partial(context, _tile_scope(block)))
        else:
            continue
        setattr(model.layers, name, wrapped)
