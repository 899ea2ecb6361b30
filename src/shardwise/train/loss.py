"""Token cross-entropy in fp32 without an fp32 copy of the whole micro-batch's logits.

`F.cross_entropy(logits.float())` keeps the fp32 log-softmax of every token for backward (4 bytes per
logit: 2.1 GB for 8 x 2048 tokens of a 32k vocabulary) and builds an fp32 gradient of the same size.
Here the tokens are taken in chunks of about LOSS_CHUNK_BYTES (spec/loss.py) of fp32 logits: forward keeps the logits as
they are (bf16 under mixed precision: half the bytes; in fp32 the same tensor the head produced) plus
one fp32 log-sum-exp per token, and backward recomputes each chunk's softmax from them. Only one chunk
is ever in fp32 (the idea of Liger-Kernel's fused linear cross-entropy, Hsu et al. 2024, arXiv
2410.10989, without fusing the head's matmul).

Per token it is the same fp32 arithmetic as F.cross_entropy (max-shifted log-sum-exp minus the target
logit); only the order in which the per-token losses are summed differs, so the loss agrees to fp32
rounding (tests/unit/test_loss.py). A micro-batch that fits one chunk (every model the CPU tests train)
takes F.cross_entropy itself, so its numbers are bit for bit those of before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.spec.loss import LOSS_CHUNK_BYTES, loss_chunk_tokens, loss_is_chunked


def token_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, tp: int = 1,
                            chunk_bytes: int = LOSS_CHUNK_BYTES) -> torch.Tensor:
    """Sum over tokens of -log softmax(logits)[target], in fp32. logits (..., V), targets (...).
    Chunked where spec/loss.py loss_is_chunked says (the planner's rule): never for TP's vocab-sharded
    DTensor logits, whose cross-entropy loss_parallel computes (the trainer's _loss_context)."""
    flat, flat_targets = logits.flatten(0, -2), targets.flatten()
    vocab = flat.shape[-1]
    if not loss_is_chunked(flat.shape[0], vocab, tp, chunk_bytes):
        return F.cross_entropy(flat.float(), flat_targets, reduction="sum")
    return _ChunkedCrossEntropy.apply(flat, flat_targets, loss_chunk_tokens(vocab, chunk_bytes))


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, logits.shape[0], chunk):
            x = logits[start:start + chunk].float()
            t = targets[start:start + chunk]
            lse[start:start + chunk] = torch.logsumexp(x, dim=-1)
            total += (lse[start:start + chunk] - x.gather(1, t[:, None]).squeeze(1)).sum()
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        logits, targets, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        rows = torch.arange(ctx.chunk, device=logits.device)
        for start in range(0, logits.shape[0], ctx.chunk):
            x = logits[start:start + ctx.chunk].float()
            t = targets[start:start + ctx.chunk]
            # d/dx of (lse - x[t]) = softmax(x) - onehot(t)
            g = torch.exp(x - lse[start:start + ctx.chunk, None])
            g[rows[:len(t)], t] -= 1
            grad[start:start + ctx.chunk] = (g * grad_total).to(logits.dtype)
        return grad, None, None
